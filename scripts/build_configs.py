"""The config files MONAI's tools read on their own, generated from the readable sources: one source of truth.

MONAI's tools read two configs alone, never layered on ``train.yaml``: the inference config (``monai.bundle run
--config_file configs/inference.yaml``, the model zoo's ``verify_bundle``, MONAI Deploy's bundle operator, which
reads it from inside ``model.ts``) and ``configs/train.json`` (``monai.bundle.load`` builds ``network_def`` from it
and nothing else). Both are generated here from ``configs/train.yaml``, where every shared setting, the network and
the CT preprocessing are written once, with the comments that explain them:

* ``configs/train.json`` -- ``train.yaml`` as JSON (JSON holds no comments: its first key says where to edit).
* ``configs/inference.yaml`` -- two parts. Above its GENERATED line, inference's own ids, written by hand (the
  source of those). Below it, every entry of ``train.yaml`` those ids need (references followed to the end, one
  level into a mapping such as ``flag``), copied verbatim with its comments, in ``train.yaml``'s order. An id
  defined by hand above the line is never copied, so each id is defined exactly once in the file.

Run ``python -m scripts.build_configs`` after editing ``train.yaml`` or inference's own part;
``python -m scripts.build_configs --check true`` exits 1 naming each stale file (tests/test_build_configs.py runs
it, so a stale file cannot land).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
#: the line that separates inference.yaml's own ids (above) from what is generated (below)
GENERATED_LINE = "# " + "=" * 40 + " GENERATED below: edit configs/train.yaml " + "=" * 34
GENERATED_NOTE = [
    "# Copied from configs/train.yaml by `python -m scripts.build_configs`: every id of train.yaml that inference's",
    "# own ids above need, with train.yaml's comments. Change these in train.yaml (one source for training, evaluation",
    "# and inference) and run the command again; tests/test_build_configs.py fails while this part is out of date.",
]
JSON_NOTE = (
    "GENERATED from configs/train.yaml by `python -m scripts.build_configs`: edit train.yaml (it holds the comments) "
    "and run that command again. monai.bundle.load and the model zoo's tests read this file."
)
#: MONAI's inference properties that a standalone inference config must define (monai.bundle.properties)
INFER_REQUIRED = ("bundle_root", "device", "dataset_dir", "dataset", "evaluator", "network_def", "inferer")
_SECTION = re.compile(r"^# -{8,}")
_TOP_KEY = re.compile(r"^([A-Za-z_+][^:#\s]*)\s*:")
_SUB_KEY = re.compile(r"^  ([A-Za-z_][^:#\s]*)\s*:")
_REF = re.compile(r"@(\w+(?:#\w+)*)")


class ConfigBuildError(ValueError):
    """A source config that cannot be turned into a standalone one; the message names the file and the id."""


@dataclass
class Entry:
    """A top-level id of a YAML source as text: its comment lines, its own lines, and its sub-entries when it is a
    mapping (``sub`` maps a second-level key to its lines, comments above it included)."""

    key: str
    section: str | None
    lead: list[str]
    lines: list[str]
    sub: dict[str, list[str]] = field(default_factory=dict)


def build(configs: Path = CONFIGS) -> dict[Path, str]:
    """The generated files' text, by path (nothing is written)."""
    train_text = (configs / "train.yaml").read_text()
    return {
        configs / "train.json": train_json(train_text),
        configs / "inference.yaml": standalone(train_text, (configs / "inference.yaml").read_text()),
    }


def write(configs: Path = CONFIGS) -> list[Path]:
    """Rewrite the generated files that differ from what the sources give; returns those rewritten."""
    texts = build(configs)
    changed = [path for path, text in texts.items() if not path.is_file() or path.read_text() != text]
    for path in changed:
        path.write_text(texts[path])
    return changed


def stale(configs: Path = CONFIGS) -> list[Path]:
    """The generated files that are missing or differ from what the sources give."""
    return [path for path, text in build(configs).items() if not path.is_file() or path.read_text() != text]


def train_json(train_text: str) -> str:
    """``train.yaml`` as the JSON ``monai.bundle.load`` reads, with a first key saying where to edit."""
    content = yaml.safe_load(train_text)
    return json.dumps({"_generated_": JSON_NOTE, **content}, indent=4) + "\n"


def standalone(train_text: str, inference_text: str) -> str:
    """``inference.yaml``: its own part as written, the GENERATED line, then what that part needs of ``train.yaml``."""
    own = inference_text.split(GENERATED_LINE)[0].rstrip("\n") + "\n"
    own_config = yaml.safe_load(own) or {}
    nested = [key for key in own_config if "#" in key or key.startswith("+")]
    if nested:
        raise ConfigBuildError(
            f"configs/inference.yaml: {nested} change ids inside other ids; a standalone config defines each id "
            "whole (write the value in full, or change it in train.yaml)."
        )
    train_config = yaml.safe_load(train_text)
    entries = parse_entries(train_text)
    chosen = needed(own_config, train_config, entries)
    return own + "\n" + GENERATED_LINE + "\n" + "\n".join(GENERATED_NOTE) + "\n" + render(entries, chosen)


def parse_entries(text: str) -> list[Entry]:
    """The top-level entries of a YAML config written as ``train.yaml`` is: keys at column 0, the comment lines right
    above a key belong to it, ``# ----- name`` lines start a section, indented lines continue the entry above."""
    entries: list[Entry] = []
    section: str | None = None
    comments: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            comments = []  # a blank line detaches comments from the next key
            continue
        if _SECTION.match(line):
            section, comments = line, []
        elif line.startswith("#"):
            comments.append(line)
        elif match := _TOP_KEY.match(line):
            entries.append(Entry(match.group(1), section, comments, [line]))
            comments = []
        elif line.startswith(" ") and entries:
            entries[-1].lines.append(line)
        else:
            raise ConfigBuildError(f"train.yaml: cannot place the line {line!r} (expected a key at column 0).")
    for entry in entries:
        entry.sub = _sub_entries(entry.lines[1:]) if entry.lines[0].rstrip().endswith(":") else {}
    return entries


def _sub_entries(lines: list[str]) -> dict[str, list[str]]:
    """Second-level keys of a mapping entry with their lines (comments at that indent go with the key below)."""
    sub: dict[str, list[str]] = {}
    pending: list[str] = []
    current: list[str] | None = None
    for line in lines:
        if line.startswith("  #"):
            pending.append(line)
        elif match := _SUB_KEY.match(line):
            current = sub[match.group(1)] = [*pending, line]
            pending = []
        elif current is not None and line.startswith("   "):
            current.append(line)
        else:
            return {}  # a list or a block scalar: taken whole
    return sub


def needed(own: dict, train: dict, entries: list[Entry]) -> dict[str, set[str] | None]:
    """Which entries of train.yaml the own part needs: key -> None for the whole entry, or the set of its
    second-level keys. References (``@id``, ``%id``) are followed from the own part and from MONAI's required
    inference properties it does not define, through everything they reach."""
    by_key = {e.key: e for e in entries}
    chosen: dict[str, set[str] | None] = {}
    missing = [key for key in INFER_REQUIRED if key not in own and key not in by_key]
    if missing:
        raise ConfigBuildError(f"neither configs/inference.yaml nor train.yaml defines {missing}: MONAI's inference "
                               "workflows require them (monai.bundle.properties.InferProperties).")  # fmt: skip
    todo = [ref for key, value in own.items() for ref in references(value, key)]
    todo += [key for key in ("imports", *INFER_REQUIRED) if key not in own and key in by_key]
    while todo:
        ref = todo.pop()
        key, *rest = ref.split("#")
        if key in own or key == "_meta_":
            continue
        if key not in by_key:
            raise ConfigBuildError(f"configs/inference.yaml needs @{ref}, which neither it nor train.yaml defines.")
        entry = by_key[key]
        if rest and rest[0] in entry.sub and chosen.get(key, set()) is not None:
            if rest[0] in chosen.setdefault(key, set()):
                continue
            chosen[key].add(rest[0])
            todo += references(train[key][rest[0]], f"{key}#{rest[0]}")
        elif key not in chosen or chosen[key] is not None:
            chosen[key] = None
            todo += references(train[key], key)
    return chosen


def references(value: object, at: str) -> list[str]:
    """The ids a config value refers to (``@id`` in an expression or as the whole value, ``%id`` macros), relative
    ids resolved from ``at``, the value's own id."""
    if isinstance(value, dict):
        return [r for k, v in value.items() for r in references(v, f"{at}#{k}")]
    if isinstance(value, list):
        return [r for i, v in enumerate(value) for r in references(v, f"{at}#{i}")]
    if not isinstance(value, str):
        return []
    from monai.bundle import ConfigParser

    text = ConfigParser.resolve_relative_ids(at.replace("#", "::"), value).replace("::", "#")
    if text.startswith("%"):
        return [text[1:]]
    if text.startswith("$") or _REF.fullmatch(text):
        return _REF.findall(text)
    return []


def render(entries: list[Entry], chosen: dict[str, set[str] | None]) -> str:
    """The chosen entries as train.yaml writes them, in its order, each section's header line once."""
    out: list[str] = []
    section = None
    for entry in entries:
        if entry.key not in chosen:
            continue
        if entry.section != section and entry.section is not None:
            out += ["", entry.section]
        section = entry.section
        out += entry.lead
        keys = chosen[entry.key]
        if keys is None:
            out += entry.lines
        else:
            out.append(entry.lines[0])
            out += [line for key, lines in entry.sub.items() if key in keys for line in lines]
    return "\n".join(out).lstrip("\n") + "\n"


def main(check: bool = False, configs: str | Path = CONFIGS) -> None:
    """Rewrite the generated configs (``--check true``: only say which are stale, exit 1 if any)."""
    from scripts.common.config import as_bool

    if as_bool(check, "check"):
        late = stale(Path(configs))
        for path in late:
            print(f"{path} is out of date: run `python -m scripts.build_configs`", file=sys.stderr)
        sys.exit(1 if late else 0)
    changed = write(Path(configs))
    print("\n".join(f"wrote {p}" for p in changed) or "every generated config is up to date")


if __name__ == "__main__":
    import fire

    fire.Fire(main)
