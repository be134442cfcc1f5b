package beamflow.launcher;

import java.io.IOException;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.function.Supplier;
import org.apache.beam.model.pipeline.v1.Endpoints;
import org.apache.beam.runners.flink.FlinkJobServerDriver;
import org.apache.beam.runners.jobsubmission.JobServerDriver;
import org.apache.beam.sdk.extensions.gcp.options.GcsOptions;
import org.apache.beam.sdk.fn.channel.SocketAddressFactory;
import org.apache.beam.sdk.fn.server.GrpcContextHeaderAccessorProvider;
import org.apache.beam.sdk.fn.server.ServerFactory;
import org.apache.beam.sdk.io.FileSystems;
import org.apache.beam.sdk.options.PipelineOptions;
import org.apache.beam.sdk.options.PipelineOptionsFactory;
import org.apache.beam.vendor.grpc.v1p60p1.io.grpc.BindableService;
import org.apache.beam.vendor.grpc.v1p60p1.io.grpc.Server;
import org.apache.beam.vendor.grpc.v1p60p1.io.grpc.ServerInterceptors;
import org.apache.beam.vendor.grpc.v1p60p1.io.grpc.netty.NettyServerBuilder;

/**
 * Beam 2.62's Flink job server, with its job and artifact-staging servers bound to 127.0.0.1 (beamflow's own).
 *
 * <p>Why: {@code FlinkJobServerDriver.main} builds both servers with {@code ServerFactory.createWithPortSupplier},
 * whose {@code InetSocketAddressServerFactory} calls {@code NettyServerBuilder.forPort(port)}: a wildcard bind, and
 * {@code --job-host} only names the URL it hands out. Anyone who reaches the job port can submit a pipeline, that is
 * run their code on the cluster. {@code FlinkJobServerDriver}'s constructor is private, but {@link JobServerDriver}'s
 * is protected and takes the two server factories: this class parses the same arguments with the public
 * {@code FlinkJobServerDriver.parseArgs} and passes factories that bind the loopback address. The expansion server
 * binds {@code --job-host} already (or is disabled with {@code --expansion-port=-1}).
 *
 * <p>On a cluster the job server must be reachable by submitters in other pods: the system property {@value
 * #BIND_PROPERTY} names the one address to bind instead (the pod's IP from the downward API), never the wildcard
 * ({@code 0.0.0.0} and {@code ::} are refused). {@code --job-host} then stays what it is in Beam, the name handed out
 * in URLs (the Kubernetes Service), and the port is bound on the named address whatever host the URL carries.
 *
 * <p>Its invoker is {@link StageNothingFlinkJobInvoker}, Beam's {@code FlinkJobInvoker} except that a job ships only
 * the files it names in {@code --files_to_stage}, not the job server's whole classpath: Beam's runner jars are on the
 * cluster's own classpath.
 *
 * <p>Compiled by {@code beamflow.services.flink} with {@code javac} against the job server's classpath (cached).
 */
public final class LoopbackJobServer extends JobServerDriver {

  /** The one address to bind instead of loopback (a cluster deployment); unset: loopback. */
  public static final String BIND_PROPERTY = "beamflow.job-server.bind-address";

  private LoopbackJobServer(
      FlinkJobServerDriver.FlinkServerConfiguration configuration,
      ServerFactory jobServerFactory,
      ServerFactory artifactServerFactory,
      JobInvokerFactory jobInvokerFactory) {
    super(configuration, jobServerFactory, artifactServerFactory, jobInvokerFactory);
  }

  public static void main(String[] args) {
    // As FlinkJobServerDriver.main: register the standard file systems, with a small GCS upload buffer.
    PipelineOptions options = PipelineOptionsFactory.create();
    options.as(GcsOptions.class).setGcsUploadBufferSizeBytes(1024 * 1024);
    FileSystems.setDefaultPipelineOptions(options);
    FlinkJobServerDriver.FlinkServerConfiguration configuration = FlinkJobServerDriver.parseArgs(args);
    String named = System.getProperty(BIND_PROPERTY, "");
    InetAddress bind = bindAddress(named);
    new LoopbackJobServer(
            configuration,
            new LoopbackServerFactory(configuration::getPort, bind, !named.isEmpty()),
            new LoopbackServerFactory(configuration::getArtifactPort, bind, !named.isEmpty()),
            () -> new StageNothingFlinkJobInvoker(configuration))
        .run();
  }

  /** Loopback when {@code named} is empty, else that one address; the wildcard is refused. */
  static InetAddress bindAddress(String named) {
    if (named.isEmpty()) {
      return InetAddress.getLoopbackAddress();
    }
    try {
      InetAddress address = InetAddress.getByName(named);
      if (address.isAnyLocalAddress()) {
        throw new IllegalArgumentException(
            BIND_PROPERTY + "=" + named + " is the wildcard: name the one address submitters reach");
      }
      return address;
    } catch (java.net.UnknownHostException e) {
      throw new IllegalArgumentException(BIND_PROPERTY + "=" + named + " is not an address: " + e, e);
    }
  }

  /**
   * Servers on one address (loopback unless {@value #BIND_PROPERTY} names another); with loopback, a URL naming any
   * other address is refused, never widened.
   */
  static final class LoopbackServerFactory extends ServerFactory {
    private static final int KEEP_ALIVE_TIME_SEC = 20; // as Beam's own factories

    private final Supplier<Integer> portSupplier;
    private final InetAddress bind;
    private final boolean named; // the bind address was named: URLs carry the advertised host, not the bind

    LoopbackServerFactory(Supplier<Integer> portSupplier, InetAddress bind, boolean named) {
      this.portSupplier = portSupplier;
      this.bind = bind;
      this.named = named;
    }

    @Override
    public Server allocateAddressAndCreate(
        List<BindableService> services, Endpoints.ApiServiceDescriptor.Builder descriptor)
        throws IOException {
      Server server = start(services, new InetSocketAddress(bind, portSupplier.get()));
      descriptor.setUrl(bind.getHostAddress() + ":" + server.getPort());
      return server;
    }

    @Override
    public Server create(List<BindableService> services, Endpoints.ApiServiceDescriptor descriptor)
        throws IOException {
      if (named) {
        // A cluster deployment: the URL's host is the name submitters use (a Service), the bind is the pod's IP.
        return start(services, new InetSocketAddress(bind, port(descriptor.getUrl())));
      }
      SocketAddress address = SocketAddressFactory.createFrom(descriptor.getUrl());
      if (!(address instanceof InetSocketAddress)) {
        throw new IOException("beamflow's job server needs a host:port address, got " + descriptor.getUrl());
      }
      InetSocketAddress inet = (InetSocketAddress) address;
      if (inet.getAddress() == null || !inet.getAddress().isLoopbackAddress()) {
        throw new IOException(
            "beamflow's job server binds loopback only; --job-host must be 127.0.0.1 or localhost, got "
                + descriptor.getUrl());
      }
      return start(services, inet);
    }

    private static int port(String url) throws IOException {
      int colon = url.lastIndexOf(':');
      try {
        return Integer.parseInt(url.substring(colon + 1));
      } catch (NumberFormatException | IndexOutOfBoundsException e) {
        throw new IOException("beamflow's job server needs a host:port address, got " + url, e);
      }
    }

    private static Server start(List<BindableService> services, InetSocketAddress address)
        throws IOException {
      NettyServerBuilder builder =
          NettyServerBuilder.forAddress(address)
              .maxInboundMessageSize(Integer.MAX_VALUE)
              .permitKeepAliveTime(KEEP_ALIVE_TIME_SEC, TimeUnit.SECONDS);
      for (BindableService service : services) {
        builder.addService(
            ServerInterceptors.intercept(service, GrpcContextHeaderAccessorProvider.interceptor()));
      }
      return builder.build().start();
    }
  }
}
