"""Reading the files a model or a LoRA adapter is made of, on this host.

Owns berth's one GGUF header reader (:mod:`.gguf_file`), the checks on a model path before it
is registered (:mod:`.model_files`: a regular GGUF file or a bounded folder walk) and on an
adapter's files against its base (:mod:`.adapter_files`: a PEFT folder or a GGUF LoRA file).
Blocking file reads with bounds, the standard library only; async callers run them in a
worker thread. The runtime (an engine's files), placement (a model's shape), the admin API's
contract (a pulled adapter) and the deployment manager (registering weights) read through it.

May import berth's base modules only.
"""
