"""Running an engine on one host: from a deployment request to a process or a container
that answers, and stopping it with everything it started.

Owns the runtime interface (:mod:`.base`: ``Runtime``, ``LaunchSpec``, ``EngineHandle``), the
engine specs (:mod:`.engines`: llama.cpp, vLLM, SGLang command lines and key delivery; the
container form :mod:`.engine_container`; the GGUF file llama.cpp loads :mod:`.gguf_folder`;
LoRA flags :mod:`.lora_flags` and the engines' adapter API :mod:`.lora_api`), the two
runtimes (:mod:`.process`, and :mod:`.docker`), whole process trees (:mod:`.trees`,
:mod:`.cgroups`, :mod:`.proc`), health probes (:mod:`.health`), engine logs
(:mod:`.engine_log`), how a process ended (:mod:`.exits`), the GPU inventory through NVML
(:mod:`.gpu`), pulling from the Hugging Face hub (:mod:`.hf_pull`), the weights shipped in
packages (:mod:`.bundled`) and how llama.cpp is built to run on any x86-64 CPU
(:mod:`.portable_build`).

A runtime knows nothing of models, settings, the store or the cluster: it is handed values
(:class:`~berth.vocab.deployment_request.DeploymentRequest`) and returns handles. May import
the vocabulary, :mod:`berth.weights` and the base modules only.
"""
