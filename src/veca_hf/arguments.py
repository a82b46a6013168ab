# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Command lines for the example scripts: flags, or a JSON / YAML file of them followed by flags that override it.

```python
from transformers import HfArgumentParser
from veca_hf.arguments import parse_args_with_file

model_args, data_args = parse_args_with_file(HfArgumentParser((ModelArguments, DataArguments)))
# python script.py args.yaml --learning_rate 1e-4      (the flag wins over the file's learning_rate)
```

NOTE: the file is read into a dict and parsed with `HfArgumentParser.parse_dict`, not turned back into argv strings:
that is what keeps `null` as `None` (as strings it became `'None'`, or failed for an int).
"""

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml
from transformers import HfArgumentParser


__all__ = ["ARGS_FILE_SUFFIXES", "parse_args_with_file", "redact_secrets", "redact_urls"]

ARGS_FILE_SUFFIXES = (".json", ".yaml", ".yml")


# Names of values that are credentials, by a part of their (lower-case) name: Hub tokens, storage keys and secrets.
_SECRET_NAME_PARTS = ("token", "secret", "password", "passwd", "credential", "key", "auth", "cookie", "signature")
_NOT_SECRET_NAMES = ("key_prefix", "keys", "push_to_hub")
# Arguments whose every value is redacted: fsspec options hold credentials under names nobody can list in advance
# (`headers`: `Authorization`, `Cookie`; `client_kwargs`; a protocol's own options).
_WHOLLY_SECRET_NAMES = ("storage_options",)
# A URL's user info (`user:pass@`) and its query string (signed URLs: `X-Amz-Signature=`, `sig=`, `token=`); a
# comma ends a URL (lists of them in one flag).
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s?#,]*@)?(?P<rest>[^\s?#'\",]*)"
                  r"(?P<query>\?[^\s#'\",]*)?")  # fmt: skip


def _is_secret_name(name: str) -> bool:
    name = name.lower()
    if name in _NOT_SECRET_NAMES or name.endswith("_tokens"):  # counts such as num_core_tokens
        return False
    return any(part in name for part in _SECRET_NAME_PARTS)


def redact_urls(text: str) -> str:
    """`text` with the user info and the query string of every URL in it replaced by placeholders:
    `https://user:pass@host/a.parquet?X-Amz-Signature=abc` -> `https://<REDACTED>@host/a.parquet?<REDACTED>`.
    Use it for every URL that is logged, stored, put in a model card or an error message."""

    def replace(match: re.Match) -> str:
        userinfo = "<REDACTED>@" if match["userinfo"] else ""
        query = "?<REDACTED>" if match["query"] and match["query"] != "?" else ""
        return f"{match['scheme']}{userinfo}{match['rest']}{query}"

    return _URL.sub(replace, text)


def _redact_every_value(values):
    if isinstance(values, dict):
        return {name: "<REDACTED>" for name in values}
    return "<REDACTED>"


def redact_secrets(values):
    """
    A copy of `values` (arguments as a dict, possibly nested, with JSON strings such as `--storage_options`) in which
    every credential is replaced by a placeholder, the way `TrainingArguments` writes `<HUB_TOKEN>`: `hub_token` ->
    `"<HUB_TOKEN>"`; any other value whose name holds "token", "secret", "password", "credential", "key", "auth",
    "cookie" or "signature" -> `"<REDACTED>"`; every value of `storage_options` (its option names stay); and the user
    info and query string of every URL (`redact_urls`). Use it for everything that reaches a disk, a log or a tracker.
    """
    if isinstance(values, dict):
        redacted = {}
        for name, value in values.items():
            if value is None or value == "" or isinstance(value, bool):
                redacted[name] = value
            elif str(name) in _WHOLLY_SECRET_NAMES:
                parsed = value
                if isinstance(value, str):
                    try:
                        parsed = json.loads(value)
                    except ValueError:
                        parsed = None
                redacted[name] = (
                    json.dumps(_redact_every_value(parsed)) if isinstance(value, str) else _redact_every_value(parsed)
                )
            elif _is_secret_name(str(name)) and not isinstance(value, dict):
                redacted[name] = f"<{str(name).upper()}>" if str(name).endswith("_token") else "<REDACTED>"
            else:
                redacted[name] = redact_secrets(value)
        return redacted
    if isinstance(values, (list, tuple)):
        return type(values)(redact_secrets(value) for value in values)
    if isinstance(values, str) and values.lstrip().startswith("{"):
        try:
            parsed = json.loads(values)
        except ValueError:
            return redact_urls(values)
        return json.dumps(redact_secrets(parsed)) if isinstance(parsed, dict) else redact_urls(values)
    if isinstance(values, str):
        return redact_urls(values)
    return values


def _read_args_file(path: str) -> dict:
    """A JSON or YAML file of `flag name -> value`, as a dict."""
    text = Path(path).read_text()
    values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(
            f"The arguments file {path!r} must hold a mapping of flag names to values, got {type(values).__name__}."
        )
    return values


def _explicit_flags(parser: HfArgumentParser, argv: Sequence[str]) -> dict:
    """Only the flags given in `argv`, converted by the parser (defaults left out, nothing required)."""
    saved = [(action, action.default, action.required) for action in parser._actions]
    try:
        for action in parser._actions:
            action.default, action.required = argparse.SUPPRESS, False
        namespace, remaining = parser.parse_known_args(list(argv))
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required
    if remaining:
        parser.error(f"unrecognized arguments: {' '.join(remaining)}")
    return vars(namespace)


def _convert_file_value(parser: HfArgumentParser, key: str, value, path: str):
    """Apply the flag's type to a file value written as text (`1e-3` is a string in YAML), keep `None` as `None`."""
    action = next((action for action in parser._actions if action.dest == key), None)
    if value is None or action is None or action.type is None or isinstance(value, (list, dict)):
        return value
    if not isinstance(value, str) and action.type is not str:
        return value
    try:
        return action.type(value if isinstance(value, str) else str(value))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{key}={value!r} in {path!r} is not a valid value for --{key}: {error}") from None


def parse_args_with_file(parser: HfArgumentParser, argv: Sequence[str] | None = None) -> tuple:
    """
    Parse `argv` into the parser's dataclasses; a leading `.json` / `.yaml` / `.yml` file supplies values that the
    flags after it override.

    Args:
        parser (`HfArgumentParser`):
            The script's parser (its dataclasses).
        argv (`Sequence[str]`, *optional*):
            The command line without the program name; `sys.argv[1:]` by default.

    Returns:
        `tuple`: one instance per dataclass of `parser`, as `parse_args_into_dataclasses` returns them.

    Raises:
        `ValueError`: if the file names a field that no dataclass has, holds a value its flag's type rejects, or a
        field without a default is given neither in the file nor as a flag.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(ARGS_FILE_SUFFIXES):
        return parser.parse_args_into_dataclasses(args=argv)
    path, flags = argv[0], argv[1:]
    values = {key: _convert_file_value(parser, key, value, path) for key, value in _read_args_file(path).items()}
    values.update(_explicit_flags(parser, flags))
    try:
        return parser.parse_dict(values)
    except ValueError as error:  # unknown keys: name the file
        raise ValueError(f"{path}: {error}") from None
    except TypeError as error:  # a field without a default is missing
        raise ValueError(f"{path}: {error}: give it in the file or as a flag after it.") from None
