"""A Beam plugin: the SDK workers Beam starts import it at start-up, which applies ``runners.worker_settings``.

Only ``sdk_worker_main`` imports it (``--beam_plugins=runners.worker_plugin``, set by ``runners.flink``); importing it
anywhere else would change that process's garbage collector and state sampler for good.
"""

from runners.worker_settings import apply

apply()
