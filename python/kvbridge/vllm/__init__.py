"""kvbridge inside vLLM: ``KVBridgeConnector``, a vLLM v1 KV connector.

Enable it with::

    KVTransferConfig(kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"disk_dir": ..., ...})

(README "vLLM" lists the extra-config keys). ``ShadowChecks`` (kvbridge.vllm.shadow) samples
converted loads, checks them against the model's own prefill and disables an adapter below the
quality floor (README "Quality while serving"). Importing this package imports vLLM and refuses a
vLLM release it was not tested with (``TESTED_VLLM_VERSIONS``).
"""
from __future__ import annotations

import re

import vllm as _vllm

#: vLLM releases the connector was tested with; other patch releases of these minors load.
TESTED_VLLM_VERSIONS = ("0.32.0",)


def _check_version(version: str) -> None:
    found = re.match(r"(\d+)\.(\d+)", version)
    minors = {tuple(v.split(".")[:2]) for v in TESTED_VLLM_VERSIONS}
    if found is None or (found.group(1), found.group(2)) not in minors:
        raise ImportError(f"kvbridge.vllm was tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)}"
                          f"; the installed vLLM is {version}, whose KV connector API may "
                          "differ. Install a tested release.")


_check_version(getattr(_vllm, "__version__", "unknown"))

from kvbridge.vllm.connector import KVBridgeConnector  # noqa: E402
from kvbridge.vllm.stats import COUNTERS, TIMERS, KVBridgeConnectorStats  # noqa: E402
from kvbridge.vllm.shadow import ShadowChecks, ShadowWorkerExtension  # noqa: E402

__all__ = ["COUNTERS", "KVBridgeConnector", "KVBridgeConnectorStats", "ShadowChecks",
           "ShadowWorkerExtension", "TESTED_VLLM_VERSIONS", "TIMERS"]
