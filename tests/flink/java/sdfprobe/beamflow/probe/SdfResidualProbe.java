package beamflow.probe;

import java.util.Set;
import java.util.TreeSet;
import org.apache.beam.model.fnexecution.v1.BeamFnApi.BundleApplication;
import org.apache.beam.model.fnexecution.v1.BeamFnApi.DelayedBundleApplication;
import org.apache.beam.model.fnexecution.v1.BeamFnApi.ProcessBundleResponse;
import org.apache.beam.runners.core.InMemoryStateInternals;
import org.apache.beam.runners.core.InMemoryTimerInternals;
import org.apache.beam.runners.core.StateInternals;
import org.apache.beam.runners.core.StateNamespace;
import org.apache.beam.runners.core.StateTag;
import org.apache.beam.runners.fnexecution.control.BundleCheckpointHandlers.StateAndTimerBundleCheckpointHandler;
import org.apache.beam.sdk.coders.Coder;
import org.apache.beam.sdk.coders.StringUtf8Coder;
import org.apache.beam.sdk.state.State;
import org.apache.beam.sdk.state.StateContext;
import org.apache.beam.sdk.transforms.windowing.GlobalWindow;
import org.apache.beam.sdk.util.CoderUtils;
import org.apache.beam.sdk.util.WindowedValue;
import org.apache.beam.vendor.grpc.v1p60p1.com.google.protobuf.ByteString;

/**
 * Drives whichever {@code StateAndTimerBundleCheckpointHandler} is first on the classpath (Beam 2.62's own, or
 * beamflow's patched one) through a number of self-checkpoints, as a deferring Kafka read makes them on portable
 * Flink, and prints how many distinct keyed states it wrote them into. Each distinct state is a Flink state
 * descriptor (on RocksDB a column family) that the job keeps for good: the count must not grow with deferrals.
 */
public final class SdfResidualProbe {
  public static void main(String[] args) throws Exception {
    int deferrals = Integer.parseInt(args[0]);
    Set<String> stateIds = new TreeSet<>();
    InMemoryStateInternals<String> memory = InMemoryStateInternals.forKey("partition-0");
    StateInternals counting =
        new StateInternals() {
          @Override
          public Object getKey() {
            return memory.getKey();
          }

          @Override
          public <T extends State> T state(StateNamespace namespace, StateTag<T> tag, StateContext<?> c) {
            stateIds.add(tag.getId());
            return memory.state(namespace, tag, c);
          }
        };
    InMemoryTimerInternals timers = new InMemoryTimerInternals();
    Coder<WindowedValue<String>> coder =
        WindowedValue.getFullCoder(StringUtf8Coder.of(), GlobalWindow.Coder.INSTANCE);
    StateAndTimerBundleCheckpointHandler<String> handler =
        new StateAndTimerBundleCheckpointHandler<>(key -> timers, key -> counting, coder, GlobalWindow.Coder.INSTANCE);
    for (int i = 0; i < deferrals; i++) {
      byte[] residual =
          CoderUtils.encodeToByteArray(coder, WindowedValue.valueInGlobalWindow("offsets-from-" + (i * 1000)));
      handler.onCheckpoint(
          ProcessBundleResponse.newBuilder()
              .addResidualRoots(
                  DelayedBundleApplication.newBuilder()
                      .setApplication(
                          BundleApplication.newBuilder().setElement(ByteString.copyFrom(residual))))
              .build());
    }
    System.out.println("deferrals=" + deferrals + " state_ids=" + stateIds.size() + " first=" + stateIds.iterator().next());
  }
}
