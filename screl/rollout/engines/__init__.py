"""The generation engines: the engine protocol (:mod:`.protocol`), the backends by name or class path
(:mod:`.registry`), the built-in torch, Megatron and vLLM engines and what they share (stop tokens, weight
buckets, routing records). An engine imports nothing else of ``screl.rollout`` but :mod:`screl.rollout.moved`;
the workflows, the server and the worker build on it."""
