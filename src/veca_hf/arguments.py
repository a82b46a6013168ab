# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Command lines for the example scripts: flags, or a JSON / YAML file of them followed by flags that override it;
the budget flags every training script shares (`SampledBudgetArguments`, `BudgetArguments`).

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
import copy
import json
import re
import shlex
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from transformers import HfArgumentParser


__all__ = [
    "ARGS_FILE_SUFFIXES",
    "BudgetArguments",
    "SampledBudgetArguments",
    "CanonicalHelpFormatter",
    "canonical_dtype",
    "check_counts",
    "parse_args_with_file",
    "redact_secrets",
    "redact_urls",
]

ARGS_FILE_SUFFIXES = (".json", ".yaml", ".yml")

# A dtype flag's value: torch's name, or the short spelling that accelerate's `--mixed_precision` also uses.
DTYPE_SPELLINGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def canonical_dtype(flag: str, value: str, allowed: Sequence[str]) -> str:
    """
    The torch name of a dtype flag's value: `"bf16"` -> `"bfloat16"`, `"fp32"` -> `"float32"`, `"fp16"` ->
    `"float16"`; torch names (and other `allowed` words such as `"auto"`) as they are.

    Args:
        flag (`str`): the flag, for the error (`"--dtype"`).
        value (`str`): what was passed.
        allowed (`Sequence[str]`): the values the flag takes, in their torch spelling (`("float32", "bfloat16")`).

    Raises:
        `ValueError`: naming the flag, the value and the values it takes, if `value` is none of them.
    """
    name = DTYPE_SPELLINGS.get(value, value)
    if name not in allowed:
        shorts = [short for short, long in DTYPE_SPELLINGS.items() if long in allowed]
        raise ValueError(
            f"{flag} {value!r} is not one of {list(allowed)}: pass one of them (or its short spelling, "
            f"{' | '.join(shorts)})."
        )
    return name


def check_counts(arguments, counts: dict[str, tuple[int, str]]) -> None:
    """At parse time, a `ValueError` naming the flag, its value and the fix for every count below its minimum
    (`counts`: flag -> (minimum, fix)), not an `IndexError` or a `ZeroDivisionError` deep in the run. `None` passes
    where the field's type allows it (it means "not set"). Call it in an argument dataclass's `__post_init__`."""
    for name, (low, fix) in counts.items():
        value = getattr(arguments, name)
        # NOTE: the annotation, not `Field.type`, which HfArgumentParser rewrites to the type without `None`
        if value is None and type(None) in typing.get_args(typing.get_type_hints(type(arguments))[name]):
            continue
        if value is None or value < low:
            raise ValueError(f"--{name} must be at least {low}, got {value}: {fix}.")


class CanonicalHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` lists each flag under its first long name (and its short ones, `-h`); its other spellings (aliases,
    which still parse) stay out."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        longs = [option for option in action.option_strings if option.startswith("--")]
        if len(longs) < 2:
            return super()._format_action_invocation(action)
        canonical = copy.copy(action)
        canonical.option_strings = [option for option in action.option_strings if option not in longs[1:]]
        return super()._format_action_invocation(canonical)


# A value is a credential when a part of its (lower-case) name is one of these: Hub tokens, storage keys, passwords,
# signatures, bearer / SAS / JSON web tokens, cookies; or when it is `storage_options` (fsspec options hold
# credentials under names nobody can list in advance: `headers`' `Authorization`, `client_kwargs`, ...).
_SECRET_NAME_PARTS = ("token", "secret", "passw", "pwd", "credential", "key", "auth", "cookie", "signature",
                      "bearer", "sas", "jwt")  # fmt: skip
_SECRET_NAMES = ("storage_options",)
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
# A character of a URL that does not start the next URL of a comma-separated list (`a.tar,https://host/b.tar`).
_IN_URL = rf"(?!,{_SCHEME})"
# A URL in free text runs from its `scheme://` to the next whitespace or quote. Its user info runs, as urllib reads
# it, up to the last `@` before the netloc ends (`/`, `?`, `#`): that part may hold commas, quotes and spaces.
_URL = re.compile(
    rf"(?P<scheme>{_SCHEME})(?:(?:{_IN_URL}[^/?#\r\n])*@)?(?:{_IN_URL}[^\s'\"/?#])*(?:{_IN_URL}[^\s'\"])*"
)
# One shell word: unquoted characters, backslash escapes and quoted strings (a command line in a log or a record).
_SHELL_WORD = re.compile(r"""(?:[^\s'"\\]|\\.|'[^']*'|"(?:[^"\\]|\\.)*")+""")
_FLAG = re.compile(r"--(?P<name>[A-Za-z][\w.-]*)(?:=(?P<value>.*))?", re.DOTALL)


def _is_secret_name(name: str) -> bool:
    name = name.lower().replace("-", "_")
    return name in _SECRET_NAMES or any(part in name for part in _SECRET_NAME_PARTS)


def redact_urls(text: str, placeholder: str = "<REDACTED>") -> str:
    """
    `text` with the credentials of every URL in it replaced by `placeholder`: the user info, the query string
    (signed URLs: `X-Amz-Signature=`, `sig=`, `token=`) and the fragment (`#token=`).
    `https://user:pass@host/a.parquet?X-Amz-Signature=abc` -> `https://<REDACTED>@host/a.parquet?<REDACTED>`; with
    `placeholder=""` they are left out: `https://host/a.parquet`. Use it for every URL that is logged, stored, put in
    a model card or an error message.

    Each URL is read by `urllib.parse.urlsplit`, as fsspec and requests read it: the user info is everything before
    the netloc's last `@` (a password may hold `,`, `@`, quotes or spaces). A URL that urllib cannot read (a port
    that is not a number: a password cut short by `/`, `?` or `#`) is redacted whole after its scheme. In a
    comma-separated list, a comma ends a URL only where the next one starts (`,https://`): a comma of a password or
    a path stays in its URL.
    """

    def replace(match: re.Match) -> str:
        scheme, url = match["scheme"], match[0]
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 (raises for a netloc urllib cannot read)
        except ValueError:
            return f"{scheme}{placeholder}"
        userinfo, at, host = parts.netloc.rpartition("@")
        redacted = f"{scheme}{f'{placeholder}@' if at and placeholder else ''}{host}{parts.path}"
        if parts.query and placeholder:
            redacted += f"?{placeholder}"
        if parts.fragment and placeholder:
            redacted += f"#{placeholder}"
        return redacted

    return _URL.sub(replace, text)


def _placeholder(name: str) -> str:
    """`<HUB_TOKEN>` for a `hub_token` (as `TrainingArguments` writes it), `<REDACTED>` for anything else."""
    name = name.lower().replace("-", "_")
    return f"<{name.upper()}>" if name.endswith("_token") else "<REDACTED>"


def _redact_named(name: str, value):
    """The value of a credential's name: redacted whole; a mapping (or its JSON) keeps its names, not its values."""
    if value is None or value == "" or isinstance(value, bool):
        return value
    if type(value) is int and name.lower().endswith(("tokens", "keys")):  # a count: num_core_tokens, max_new_tokens
        return value
    parsed = value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            pass
    if isinstance(parsed, dict):
        redacted = {key: "<REDACTED>" for key in parsed}
        return json.dumps(redacted) if isinstance(value, str) else redacted
    return _placeholder(name)


def _unclosed(value: str) -> bool:
    return value.count("{") + value.count("[") > value.count("}") + value.count("]")


def _redact_argv(words: list[str]) -> dict[int, str | None]:
    """The values of credential flags in `words` (a command line split into words) as `{index: replacement}`;
    `None` where a word was part of a value the shell split (unquoted JSON: `{"key": "abc"}`)."""
    replacements = {}
    index = 0
    while index < len(words):
        match = _FLAG.fullmatch(words[index]) if isinstance(words[index], str) else None
        if match and _is_secret_name(match["name"]):
            if match["value"] is not None:  # --name=value
                replacements[index] = f"--{match['name']}={_redact_named(match['name'], match['value'])}"
            elif index + 1 < len(words) and isinstance(words[index + 1], str) and not words[index + 1].startswith("-"):
                end, value = index + 1, words[index + 1]
                while _unclosed(value) and end + 1 < len(words):  # unquoted JSON that the shell split at spaces
                    end += 1
                    value += f" {words[end]}"
                replacements[index + 1] = _redact_named(match["name"], value)
                replacements.update(dict.fromkeys(range(index + 2, end + 1)))
                index = end
        index += 1
    return replacements


def _redact_command(text: str) -> str:
    """`text` with the values of its credential flags (`--hub_token X`, `--hub_token=X`, `--storage_options '{..}'`)
    redacted, read as a shell would split it; the rest of the text stays as it was."""
    spans = [match.span() for match in _SHELL_WORD.finditer(text)]
    words = []
    for start, end in spans:
        try:
            words.append(" ".join(shlex.split(text[start:end])))
        except ValueError:  # an unclosed quote
            words.append(text[start:end])
    replacements = _redact_argv(words)
    for index in sorted(replacements, reverse=True):
        start, end = spans[index]
        new = replacements[index]
        if new is None:  # joined into the previous word's value: drop it and the whitespace before it
            start = spans[index - 1][1]
            new = ""
        elif re.search(r"[\s'\"\\]", new):
            new = shlex.quote(new)
        text = text[:start] + new + text[end:]
    return text


def redact_secrets(values):
    """
    A copy of `values` (arguments as a dict, possibly nested; a list of command-line words; a string) in which every
    credential is replaced by a placeholder. Use it for everything that reaches a disk, a log, a tracker or a card.

    - By name: a value whose (lower-case) name holds "token", "secret", "passw", "pwd", "credential", "key", "auth",
      "cookie", "signature", "bearer", "sas" or "jwt", or is `storage_options`, is redacted whole: `hub_token` ->
      `"<HUB_TOKEN>"` (the way `TrainingArguments` writes it), others -> `"<REDACTED>"`; a mapping (or its JSON)
      keeps its names and loses every value. Left as they are: `None`, `""`, booleans, and integers under a plural
      name (counts such as `num_core_tokens`).
    - In command lines: the value of a flag with such a name, in a list of words (`["--hub_token", "X"]`) or in a
      string a shell would split (`"... --hub_token X"`, `--hub_token=X`, `--storage_options '{...}'`).
    - In every string: the user info, query string and fragment of every URL (`redact_urls`).
    """
    if isinstance(values, dict):
        return {
            name: _redact_named(str(name), value) if _is_secret_name(str(name)) else redact_secrets(value)
            for name, value in values.items()
        }
    if isinstance(values, (list, tuple)):
        replacements = _redact_argv(list(values))
        redacted = [
            replacements[index] if index in replacements else redact_secrets(value)
            for index, value in enumerate(values)
            if index not in replacements or replacements[index] is not None
        ]
        return type(values)(redacted)
    if isinstance(values, str):
        if values.lstrip().startswith(("{", "[")):  # JSON (of --storage_options, say): redacted as what it holds
            try:
                parsed = json.loads(values)
            except ValueError:
                pass
            else:
                redacted = redact_secrets(parsed)
                return values if redacted == parsed else json.dumps(redacted)
        return redact_urls(_redact_command(values))
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


def _aliases(parser: HfArgumentParser) -> dict[str, str]:
    """Every alias of a flag (`image_column`), without its dashes, -> its field (`image_column_name`)."""
    return {
        option.lstrip("-"): action.dest
        for action in parser._actions
        for option in action.option_strings[1:]
        if option.startswith("--") and option.lstrip("-") != action.dest
    }


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
    flags after it override. A field's aliases (`field(metadata={"aliases": ["--old_name"]})`) work as flags and as
    file keys; `--help` shows only the field's own name.

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
    if parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter:  # HfArgumentParser's default
        parser.formatter_class = CanonicalHelpFormatter
    if not argv or not argv[0].endswith(ARGS_FILE_SUFFIXES):
        return parser.parse_args_into_dataclasses(args=argv)
    path, flags = argv[0], argv[1:]
    aliases = _aliases(parser)  # a file written with an alias (`image_column:`) reads as its flag does
    values = {
        aliases.get(key, key): _convert_file_value(parser, aliases.get(key, key), value, path)
        for key, value in _read_args_file(path).items()
    }
    values.update(_explicit_flags(parser, flags))
    try:
        return parser.parse_dict(values)
    except ValueError as error:  # unknown keys: name the file
        raise ValueError(f"{path}: {error}") from None
    except TypeError as error:  # a field without a default is missing
        raise ValueError(f"{path}: {error}: give it in the file or as a flag after it.") from None


@dataclass
class SampledBudgetArguments:
    """The budgets drawn per optimiser step: the flags distillation and fine-tuning share."""

    budgets: str | None = field(
        default=None,
        metadata={
            "help": "Budgets drawn per step, e.g. '8,16,32'. Default: every budget of the model (the multiples of "
            "core_chunk_size up to num_core_tokens: 8,16,...,64 for the presets)."
        },
    )
    budget_weights: str | None = field(
        default=None,
        metadata={
            "help": "Sampling weights of --budgets. Default: ceil(4 i / K) for the i-th smallest of K budgets "
            "(1,1,2,2,3,3,4,4 for 8 budgets, as in the paper)."
        },
    )


@dataclass
class BudgetArguments(SampledBudgetArguments):
    """How many cores (the budget C) to train and evaluate with: the flags every fine-tuning script shares."""

    num_core_tokens: int | None = field(
        default=None,
        metadata={"help": "Training budget (without --sample_budgets), saved as the model's default budget."},
    )
    sample_budgets: bool = field(default=False, metadata={"help": "Draw the budget of every optimiser step."})
    eval_budgets: str | None = field(
        default=None,
        metadata={"help": "Budgets to evaluate at, e.g. '8,16,64' (default: smallest, training default, largest)."},
    )
