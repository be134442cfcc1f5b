"""After each variant: what its sinks and consumer group hold, against what the generator produced."""

from __future__ import annotations

from typing import Any


def audit(config: dict[str, Any], expected: dict[str, int]) -> dict[str, Any]:
    """What one variant left in its sinks and its consumer group; ``problems`` lists every mismatch (empty = clean).

    ``expected``: produced ``events``, ``duplicate_sends`` and ``bad_records`` (from the generator).
    """
    import psycopg
    from confluent_kafka import Consumer
    from confluent_kafka import TopicPartition as CkTopicPartition
    from psycopg import sql

    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    kafka, pg, ice = config["kafka"], config["postgres"], config["iceberg"]
    out: dict[str, Any] = {}
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"].get("uri", "")))
    try:
        ids = catalog.load_table(ice["table"]).scan(selected_fields=("event_id",)).to_arrow()["event_id"].to_pylist()
    except Exception as exc:  # reported as a problem
        ids, out["iceberg_error"] = [], f"{type(exc).__name__}: {exc}"
    out["iceberg_rows"], out["iceberg_ids"] = len(ids), len(set(ids))
    with psycopg.connect(pg["dsn"], autocommit=True) as conn:

        def scalar(query: sql.Composed) -> int:
            try:
                row = conn.execute(query).fetchone()
            except psycopg.errors.UndefinedTable:
                return -1
            return int(row[0]) if row else 0

        for name, key in (("quarantined", "quarantine_table"), ("dead_letters", "dead_letters_table")):
            out[name] = scalar(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(pg[key])))
        table = sql.Identifier(pg["sessions_table"])
        out["sessions"] = scalar(sql.SQL("SELECT count(*) FROM {}").format(table))
        out["session_events"] = scalar(sql.SQL("SELECT coalesce(sum(events), 0) FROM {}").format(table))
        out["session_keys_twice"] = scalar(
            sql.SQL(
                "SELECT count(*) FROM (SELECT user_id, session_start FROM {} GROUP BY 1, 2 HAVING count(*) > 1) d"
            ).format(table)
        )
    consumer = Consumer({"bootstrap.servers": kafka["bootstrap"], "group.id": kafka["group_id"]})
    try:
        topic = kafka["topic"]
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        tps = [CkTopicPartition(topic, p) for p in partitions]
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1] for tp in tps}
        committed = {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10)}
    finally:
        consumer.close()
    out["end_offsets"], out["committed_offsets"] = ends, committed
    problems = [out["iceberg_error"]] if "iceberg_error" in out else []
    for what, got, want in (
        ("iceberg rows", out["iceberg_rows"], expected["events"]),
        ("iceberg distinct event ids", out["iceberg_ids"], expected["events"]),
        ("quarantined duplicates", out["quarantined"], expected["duplicate_sends"]),
        ("dead letters", out["dead_letters"], expected["bad_records"]),
        ("events covered by sessions", out["session_events"], expected["events"]),
        ("session keys written twice", out["session_keys_twice"], 0),
    ):
        if got != want:
            problems.append(f"{what}: {got}, expected {want}")
    behind = {p: (committed.get(p), end) for p, end in ends.items() if committed.get(p) != end}
    if behind:
        problems.append(f"committed offsets != end offsets on partitions {behind} (partition: (committed, end))")
    out["problems"] = problems
    return out
