"""Runner profiles: the pinned local runner for tests and the demo, and FlinkRunner options from conf/*.yaml."""
