"""A local stack for `tiercache demo` and `tiercache bench`, and for the tests and
benchmarks that run the product the same way: redis-server and moto's S3 server on
loopback (servers.py), a tiny random Llama (model.py), a vLLM engine in a process of
its own (vllm_runner.py) and vLLM's OpenAI server (serving.py). Helpers only tests
use (fault proxies, a throwaway TLS CA) live in tests/support/, outside the wheel."""
