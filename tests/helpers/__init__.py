"""Code the tests share: request and KV-manager factories, hypothesis strategies, the invariant
checker, hand-made traces, and harnesses for servers, ranks and interpreted kernels."""
