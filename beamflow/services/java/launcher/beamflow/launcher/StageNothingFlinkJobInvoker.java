package beamflow.launcher;

import java.lang.reflect.Method;
import java.util.List;
import java.util.UUID;
import org.apache.beam.model.pipeline.v1.RunnerApi;
import org.apache.beam.runners.flink.FlinkJobInvoker;
import org.apache.beam.runners.flink.FlinkJobServerDriver;
import org.apache.beam.runners.flink.FlinkPipelineOptions;
import org.apache.beam.runners.flink.FlinkPipelineRunner;
import org.apache.beam.runners.jobsubmission.JobInvocation;
import org.apache.beam.sdk.options.PortablePipelineOptions;
import org.apache.beam.sdk.util.construction.PipelineOptionsTranslation;
import org.apache.beam.vendor.grpc.v1p60p1.com.google.protobuf.Struct;
import org.apache.beam.vendor.guava.v32_1_2_jre.com.google.common.base.Strings;
import org.apache.beam.vendor.guava.v32_1_2_jre.com.google.common.util.concurrent.ListeningExecutorService;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Beam 2.62's {@link FlinkJobInvoker}, staging only the files the job names in {@code --files_to_stage} (beamflow's own).
 *
 * <p>Why: {@code FlinkJobInvoker.invokeWithExecutor} builds {@code new FlinkPipelineRunner(options, confDir,
 * detectClassPathResourcesToStage(classLoader, options))}: the job server JVM's whole classpath (about 165 jars, 190
 * MB), whatever the job's {@code filesToStage} says, and Flink's {@code RemoteStreamEnvironment} uploads every one of
 * them to the cluster's blob store with every job (then each TaskManager running a task of the job downloads them).
 * beamflow's cluster has Beam's runner jars on its own classpath ({@code lib/}), so a job needs none of them. This
 * invoker does what Beam's does (options from the proto, {@code [auto]} master from {@code --flink-master}, the job
 * invocation) but hands the public {@code FlinkPipelineRunner} constructor the job's own {@code filesToStage} (none
 * when unset). A job with {@code --output_executable_path} (Beam's jar creator) goes to Beam's invoker unchanged.
 *
 * <p>{@code FlinkServerConfiguration}'s getters are package-private in 2.62; they are read once, by reflection, when the
 * job server starts (so a Beam that changes them fails at start, not at the first submission).
 */
final class StageNothingFlinkJobInvoker extends FlinkJobInvoker {
  private static final Logger LOG = LoggerFactory.getLogger(StageNothingFlinkJobInvoker.class);

  private final String flinkMaster;
  private final String flinkConfDir;

  StageNothingFlinkJobInvoker(FlinkJobServerDriver.FlinkServerConfiguration configuration) {
    super(configuration);
    this.flinkMaster = read(configuration, "getFlinkMaster");
    this.flinkConfDir = read(configuration, "getFlinkConfDir");
  }

  @Override
  protected JobInvocation invokeWithExecutor(
      RunnerApi.Pipeline pipeline,
      Struct options,
      String retrievalToken,
      ListeningExecutorService executorService) {
    FlinkPipelineOptions flinkOptions =
        PipelineOptionsTranslation.fromProto(options).as(FlinkPipelineOptions.class);
    if (!Strings.isNullOrEmpty(
        flinkOptions.as(PortablePipelineOptions.class).getOutputExecutablePath())) {
      return super.invokeWithExecutor(pipeline, options, retrievalToken, executorService);
    }
    String invocationId = String.format("%s_%s", flinkOptions.getJobName(), UUID.randomUUID());
    if (FlinkPipelineOptions.AUTO.equals(flinkOptions.getFlinkMaster())) {
      flinkOptions.setFlinkMaster(flinkMaster);
    }
    List<String> filesToStage =
        flinkOptions.getFilesToStage() == null ? List.of() : List.copyOf(flinkOptions.getFilesToStage());
    FlinkPipelineRunner runner = new FlinkPipelineRunner(flinkOptions, flinkConfDir, filesToStage);
    flinkOptions.setRunner(null);
    LOG.info(
        "Invoking job {} staging {} file(s) {} (Beam's runner comes from the cluster's classpath)",
        invocationId,
        filesToStage.size(),
        filesToStage);
    return createJobInvocation(
        invocationId, retrievalToken, executorService, pipeline, flinkOptions, runner);
  }

  private static String read(FlinkJobServerDriver.FlinkServerConfiguration configuration, String getter) {
    try {
      Method method = FlinkJobServerDriver.FlinkServerConfiguration.class.getDeclaredMethod(getter);
      method.setAccessible(true);
      return (String) method.invoke(configuration);
    } catch (ReflectiveOperationException | RuntimeException e) {
      throw new IllegalStateException(
          "beamflow's job server needs FlinkServerConfiguration." + getter + "() (Beam 2.62)", e);
    }
  }
}
