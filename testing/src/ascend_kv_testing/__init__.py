# SPDX-License-Identifier: Apache-2.0
"""Test support for vllm-ascend-distributed (not published).

* :mod:`.fake_torch_npu` - a ``torch_npu`` stand-in with the real signatures;
* :mod:`.mooncake` - start and stop ``mooncake_master`` / ``mooncake_client`` on loopback;
* :mod:`.models` - a tiny random-weight Llama and a locally trained tokenizer;
* :mod:`.pytest_plugin` - fixtures, activated as a pytest plugin.

Fakes are activated explicitly (a fixture or ``install()``), never by import order.
"""
