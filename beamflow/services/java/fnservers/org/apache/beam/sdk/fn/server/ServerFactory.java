package org.apache.beam.sdk.fn.server;

import java.io.File;
import java.io.IOException;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.function.Supplier;
import org.apache.beam.model.pipeline.v1.Endpoints;
import org.apache.beam.sdk.fn.channel.SocketAddressFactory;
import org.apache.beam.vendor.grpc.v1p60p1.io.grpc.BindableService;
import org.apache.beam.vendor.grpc.v1p60p1.io.grpc.Server;
import org.apache.beam.vendor.grpc.v1p60p1.io.grpc.ServerInterceptors;
import org.apache.beam.vendor.grpc.v1p60p1.io.grpc.netty.NettyServerBuilder;
import org.apache.beam.vendor.grpc.v1p60p1.io.netty.channel.epoll.EpollEventLoopGroup;
import org.apache.beam.vendor.grpc.v1p60p1.io.netty.channel.epoll.EpollServerDomainSocketChannel;
import org.apache.beam.vendor.grpc.v1p60p1.io.netty.channel.epoll.EpollServerSocketChannel;
import org.apache.beam.vendor.grpc.v1p60p1.io.netty.channel.unix.DomainSocketAddress;

/**
 * beamflow's stand-in for Beam 2.62's {@code ServerFactory} (same package, class name and public API), placed ahead of
 * Beam's jars on the local Flink cluster's classpath ({@code <data>/flink/lib/0-beamflow-loopback-fn-servers.jar}).
 *
 * <p>Why: a TaskManager opens the Fn API servers of a job's Python workers (control, data, state, logging,
 * provisioning, artifact retrieval) through {@code DefaultJobBundleFactory}, which takes its factory from {@code
 * EnvironmentFactory.Provider.getServerFactory()}, that is {@code ServerFactory.createDefault()}. Beam's
 * implementation advertises {@code localhost:<port>} but binds with {@code NettyServerBuilder.forPort(port)}, every
 * interface, and no option or hook changes it: anyone who reaches such a port can speak the Fn API to the worker
 * side of a running job. Replacing this one class is the smallest contained change: every other Beam class is
 * untouched, and it is on no classpath but the local cluster's. It binds the loopback address and advertises {@code
 * 127.0.0.1:<port>}. (Beam's Docker-on-macOS factory, which hands {@code host.docker.internal} to containers, needs
 * the wildcard and cannot work with it; the local cluster runs PROCESS or EXTERNAL workers.)
 *
 * <p>Written for beamflow against Beam 2.62's API; {@code tests/flink/test_loopback_only.py} lists every listening
 * socket of the cluster with a job running.
 */
public abstract class ServerFactory {

  private static final int KEEP_ALIVE_TIME_SEC = 20;

  public static ServerFactory createDefault() {
    return new InetSocketAddressServerFactory(UrlFactory.createDefault(), () -> 0);
  }

  public static ServerFactory createWithUrlFactory(UrlFactory urlFactory) {
    return new InetSocketAddressServerFactory(urlFactory, () -> 0);
  }

  public static ServerFactory createWithPortSupplier(Supplier<Integer> portSupplier) {
    return new InetSocketAddressServerFactory(UrlFactory.createDefault(), portSupplier);
  }

  public static ServerFactory createWithUrlFactoryAndPortSupplier(
      UrlFactory urlFactory, Supplier<Integer> portSupplier) {
    return new InetSocketAddressServerFactory(urlFactory, portSupplier);
  }

  public static ServerFactory createEpollSocket() {
    return new EpollLoopback();
  }

  public static ServerFactory createEpollDomainSocket() {
    return new EpollUnixSocket();
  }

  /** A server on an address of the factory's choosing; its URL is written into {@code builder}. */
  public abstract Server allocateAddressAndCreate(
      List<BindableService> services, Endpoints.ApiServiceDescriptor.Builder builder)
      throws IOException;

  /** A server on the address {@code serviceDescriptor} names. */
  public abstract Server create(
      List<BindableService> services, Endpoints.ApiServiceDescriptor serviceDescriptor)
      throws IOException;

  /** TCP servers on the loopback address. */
  public static class InetSocketAddressServerFactory extends ServerFactory {
    private final UrlFactory urlFactory;
    private final Supplier<Integer> portSupplier;

    private InetSocketAddressServerFactory(UrlFactory urlFactory, Supplier<Integer> portSupplier) {
      this.urlFactory = urlFactory;
      this.portSupplier = portSupplier;
    }

    @Override
    public Server allocateAddressAndCreate(
        List<BindableService> services, Endpoints.ApiServiceDescriptor.Builder builder)
        throws IOException {
      InetAddress loopback = InetAddress.getLoopbackAddress();
      Server server = build(forLoopback(portSupplier.get()), services);
      builder.setUrl(urlFactory.createUrl(loopback.getHostAddress(), server.getPort()));
      return server;
    }

    @Override
    public Server create(
        List<BindableService> services, Endpoints.ApiServiceDescriptor serviceDescriptor)
        throws IOException {
      return build(forLoopback(inetPort(serviceDescriptor)), services);
    }
  }

  /** As {@link InetSocketAddressServerFactory}, on Netty's epoll transport. */
  private static final class EpollLoopback extends ServerFactory {
    @Override
    public Server allocateAddressAndCreate(
        List<BindableService> services, Endpoints.ApiServiceDescriptor.Builder builder)
        throws IOException {
      Server server = build(epoll(forLoopback(0), EpollServerSocketChannel.class), services);
      builder.setUrl(
          UrlFactory.createDefault()
              .createUrl(InetAddress.getLoopbackAddress().getHostAddress(), server.getPort()));
      return server;
    }

    @Override
    public Server create(
        List<BindableService> services, Endpoints.ApiServiceDescriptor serviceDescriptor)
        throws IOException {
      return build(
          epoll(forLoopback(inetPort(serviceDescriptor)), EpollServerSocketChannel.class), services);
    }
  }

  /** Unix domain sockets under {@code java.io.tmpdir} (never reachable over a network). */
  private static final class EpollUnixSocket extends ServerFactory {
    @Override
    public Server allocateAddressAndCreate(
        List<BindableService> services, Endpoints.ApiServiceDescriptor.Builder builder)
        throws IOException {
      File socket;
      do {
        socket =
            new File(
                System.getProperty("java.io.tmpdir"),
                "fnapi" + java.util.concurrent.ThreadLocalRandom.current().nextInt(10000) + ".sock");
      } while (socket.exists());
      builder.setUrl("unix://" + socket.getAbsolutePath());
      return create(services, builder.build());
    }

    @Override
    public Server create(
        List<BindableService> services, Endpoints.ApiServiceDescriptor serviceDescriptor)
        throws IOException {
      SocketAddress address = SocketAddressFactory.createFrom(serviceDescriptor.getUrl());
      if (!(address instanceof DomainSocketAddress)) {
        throw new IllegalArgumentException(
            "a Unix domain socket address is needed, got " + serviceDescriptor.getUrl());
      }
      return build(
          epoll(NettyServerBuilder.forAddress(address), EpollServerDomainSocketChannel.class),
          services);
    }
  }

  /** A factory that turns the address and port a server listens on into the URL its clients use. */
  @FunctionalInterface
  public interface UrlFactory {
    String createUrl(String address, int port);

    static UrlFactory createDefault() {
      return (host, port) -> (host.indexOf(':') >= 0 ? "[" + host + "]" : host) + ":" + port;
    }
  }

  private static int inetPort(Endpoints.ApiServiceDescriptor serviceDescriptor) {
    SocketAddress address = SocketAddressFactory.createFrom(serviceDescriptor.getUrl());
    if (!(address instanceof InetSocketAddress)) {
      throw new IllegalArgumentException(
          "a host:port address is needed, got " + serviceDescriptor.getUrl());
    }
    return ((InetSocketAddress) address).getPort();
  }

  private static NettyServerBuilder forLoopback(int port) {
    return NettyServerBuilder.forAddress(new InetSocketAddress(InetAddress.getLoopbackAddress(), port));
  }

  private static NettyServerBuilder epoll(
      NettyServerBuilder builder,
      Class<? extends org.apache.beam.vendor.grpc.v1p60p1.io.netty.channel.ServerChannel> channel) {
    return builder
        .channelType(channel)
        .workerEventLoopGroup(new EpollEventLoopGroup())
        .bossEventLoopGroup(new EpollEventLoopGroup());
  }

  private static Server build(NettyServerBuilder builder, List<BindableService> services)
      throws IOException {
    builder.maxInboundMessageSize(Integer.MAX_VALUE).permitKeepAliveTime(KEEP_ALIVE_TIME_SEC, TimeUnit.SECONDS);
    for (BindableService service : services) {
      // The worker id header each SDK harness sends, as Beam's own factories do.
      builder.addService(
          ServerInterceptors.intercept(service, GrpcContextHeaderAccessorProvider.interceptor()));
    }
    return builder.build().start();
  }
}
