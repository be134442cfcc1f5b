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
 * <p>Its invoker is {@link StageNothingFlinkJobInvoker}, Beam's {@code FlinkJobInvoker} except that a job ships only
 * the files it names in {@code --files_to_stage}, not the job server's whole classpath: Beam's runner jars are on the
 * cluster's own classpath.
 *
 * <p>Compiled by {@code beamflow.services.flink} with {@code javac} against the job server's classpath (cached).
 */
public final class LoopbackJobServer extends JobServerDriver {

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
    new LoopbackJobServer(
            configuration,
            new LoopbackServerFactory(configuration::getPort),
            new LoopbackServerFactory(configuration::getArtifactPort),
            () -> new StageNothingFlinkJobInvoker(configuration))
        .run();
  }

  /** Servers on the loopback address only; a URL naming any other address is refused, never widened. */
  static final class LoopbackServerFactory extends ServerFactory {
    private static final int KEEP_ALIVE_TIME_SEC = 20; // as Beam's own factories

    private final Supplier<Integer> portSupplier;

    LoopbackServerFactory(Supplier<Integer> portSupplier) {
      this.portSupplier = portSupplier;
    }

    @Override
    public Server allocateAddressAndCreate(
        List<BindableService> services, Endpoints.ApiServiceDescriptor.Builder descriptor)
        throws IOException {
      InetAddress loopback = InetAddress.getLoopbackAddress();
      Server server = start(services, new InetSocketAddress(loopback, portSupplier.get()));
      descriptor.setUrl(loopback.getHostAddress() + ":" + server.getPort());
      return server;
    }

    @Override
    public Server create(List<BindableService> services, Endpoints.ApiServiceDescriptor descriptor)
        throws IOException {
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
