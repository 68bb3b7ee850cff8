"""Operations: the `tiercache` CLI, the service (`tiercache serve`), demo, bench,
inspect (object_info), the configuration reference (config_docs), and the local
stack the demo and bench start (local_stack, tiny_model, vllm_runner)."""
