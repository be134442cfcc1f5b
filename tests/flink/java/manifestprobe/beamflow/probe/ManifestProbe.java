package beamflow.probe;

import java.io.File;
import java.util.ArrayList;
import java.util.List;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.contrib.streaming.state.ConfigurableRocksDBOptionsFactory;
import org.rocksdb.ColumnFamilyDescriptor;
import org.rocksdb.ColumnFamilyHandle;
import org.rocksdb.ColumnFamilyOptions;
import org.rocksdb.DBOptions;
import org.rocksdb.FlushOptions;
import org.rocksdb.RocksDB;

/**
 * What Flink does to a keyed operator's RocksDB at every checkpoint, as beamflow's Kafka read uses it: a few entries
 * written and removed in a few column families, then a flush. Prints the MANIFEST's size after {@code rounds} of that,
 * with RocksDB's defaults ({@code none}) or with beamflow's options factory configured to {@code bytes}.
 *
 * <p>Usage: {@code ManifestProbe <db dir> <rounds> <none|bytes>}; prints {@code rounds=N manifest_bytes=M manifests=K}.
 */
public final class ManifestProbe {
  private ManifestProbe() {}

  public static void main(String[] args) throws Exception {
    File dir = new File(args[0]);
    int rounds = Integer.parseInt(args[1]);
    RocksDB.loadLibrary();
    DBOptions dbOptions = new DBOptions().setCreateIfMissing(true).setCreateMissingColumnFamilies(true);
    if (!"none".equals(args[2])) {
      // Loaded by name, as Flink loads state.backend.rocksdb.options-factory (the jar is on the classpath only).
      Configuration conf = new Configuration();
      conf.setString("beamflow.rocksdb.max-manifest-file-size", args[2] + " bytes");
      ConfigurableRocksDBOptionsFactory factory =
          (ConfigurableRocksDBOptionsFactory)
              Class.forName("beamflow.flink.BoundedManifestOptionsFactory").getDeclaredConstructor().newInstance();
      dbOptions = factory.configure(conf).createDBOptions(dbOptions, new ArrayList<>());
    }
    List<ColumnFamilyDescriptor> families = new ArrayList<>();
    families.add(new ColumnFamilyDescriptor(RocksDB.DEFAULT_COLUMN_FAMILY, new ColumnFamilyOptions()));
    for (String name : new String[] {"residuals", "_timer_state/processing_user-timers", "watermark"}) {
      families.add(new ColumnFamilyDescriptor(name.getBytes(), new ColumnFamilyOptions()));
    }
    List<ColumnFamilyHandle> handles = new ArrayList<>();
    try (RocksDB db = RocksDB.open(dbOptions, dir.getPath(), families, handles);
        FlushOptions flush = new FlushOptions().setWaitForFlush(true)) {
      for (int round = 0; round < rounds; round++) {
        for (ColumnFamilyHandle handle : handles.subList(1, handles.size())) {
          byte[] key = ("partition-" + (round % 4)).getBytes();
          db.put(handle, key, ("offset-" + round).getBytes());
          if (round > 0) {
            db.delete(handle, ("partition-" + ((round - 1) % 4)).getBytes());
          }
        }
        db.flush(flush, handles);
      }
    }
    long bytes = 0;
    int manifests = 0;
    for (File file : dir.listFiles()) {
      if (file.getName().startsWith("MANIFEST-")) {
        manifests++;
        bytes = Math.max(bytes, file.length());
      }
    }
    System.out.println("rounds=" + rounds + " manifest_bytes=" + bytes + " manifests=" + manifests);
  }
}
