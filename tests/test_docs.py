"""The docs stay true: what a user copies from the README and the pages under ``docs/`` works as written.

* every ``python -m <module>`` they show imports and answers ``--help``;
* every ``--<id>`` they give ``monai.bundle run`` exists in the configs the command layers (and so does its workflow
  name: ``training``, ``evaluate``, ``inference``);
* every repository path they name exists (paths under the folders a user creates -- ``runs/``, ``models/``, ... --
  are not checked), and every ``scripts.<module>`` they name is a module of the bundle;
* every link between the pages resolves, to a file and to a heading;
* the README stays a front page: at most 200 lines, two quick-start commands, the second the one CI runs, each time it
  quotes the one in ``docs/performance.md``, and it links the requirements page before its quick start ends;
* every page and section that a page, a config's comment, the Dockerfile or a requirements file points to exists
  (``docs/training.md "Docker"``, ``README, "X"``, ``docs/x.md#anchor``);
* each config default a page states is the config's (a table below), and so is the CPU's cap of ``num_workers: auto``
  and the GPU kit's default budget.

``CHANGELOG.md`` and the GPU runs' folders are history: only their links are checked.
"""

from __future__ import annotations

import ast
import glob
import json
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = [ROOT / "CHANGELOG.md", *sorted((ROOT / "docs" / "gpu-runs").rglob("*.md"))]
# folders and files the user makes (by training, inference, MONAI Label, the kit): named in the docs, not in the repo
USER_MADE = ("runs/", "models/", "apps/", "studies/", ".whl/")
# arguments of `monai.bundle run` that are not config ids
RUN_ARGUMENTS = {"config_file", "meta_file", "logging_file", "args_file", "tracking", "run_id", "init_id", "final_id"}
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def code_of(page: Path) -> tuple[list[str], list[str]]:
    """The page's shell lines (fenced blocks that are not Python or YAML, continuations joined) and its inline code."""
    text = page.read_text()
    lines = []
    for language, block in FENCE.findall(text):
        if language in ("", "bash", "sh", "console"):
            lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    prose = FENCE.sub("", text)
    return lines, INLINE.findall(prose.replace("\n", " "))


def commands(page: Path) -> list[list[str]]:
    """Each command of the page (its shell lines and inline code that starts a program), as words; optional parts
    written ``[--id value]`` are kept without their brackets."""
    lines, inline = code_of(page)
    found = []
    for line in lines + [c for c in inline if c.startswith(("python", "torchrun", "sbatch"))]:
        line = re.sub(r"\[(--[^\]]+)\]", r"\1", line)
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote in a fragment of prose
            continue
        current: list[str] = []
        for word in words:
            if word in ("&&", "||", ";", "|"):
                found.append(current)
                current = []
            else:
                current.append(word)
        found.append(current)
    return [c for c in found if c]


def python_modules(words: list[str]) -> list[tuple[str, list[str]]]:
    """``(module, arguments)`` of a ``python -m`` or ``torchrun ... -m`` command."""
    if not words or not (re.fullmatch(r"python3?", words[0]) or words[0] == "torchrun"):
        return []
    if "-m" not in words[:-1]:
        return []
    at = words.index("-m")
    return [(words[at + 1], words[at + 2 :])]


def shown_modules() -> dict[str, list[str]]:
    """Every module a page runs with ``python -m``, with the pages that show it."""
    modules: dict[str, list[str]] = {}
    for page in PAGES:
        for words in commands(page):
            for module, _ in python_modules(words):
                if module not in ("pip", "pytest", "venv"):
                    modules.setdefault(module, []).append(page.name)
    return modules


_HELP_CHECK = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])
result = {}
for module in sys.argv[2:]:
    out = io.StringIO()
    sys.argv = [module, "--help"]
    code = "returned without printing help"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            code = stop.code or 0
        except BaseException as error:
            code = f"{type(error).__name__}: {error}"
    result[module] = {"code": code, "output": out.getvalue()[-2000:]}
print(json.dumps(result))
"""


def test_every_module_the_docs_run_answers_help(tmp_path):
    """``python -m <module> --help`` for every module the pages show, each in turn in one child process started
    outside the bundle (as a user from another folder with the bundle on PYTHONPATH): it prints its help and exits 0
    (a command that runs instead, or fails, is reported)."""
    modules = shown_modules()
    assert "monai.bundle" in modules and "scripts.prepare" in modules, sorted(modules)
    # a process of its own, forked from the tests' zygote (tests/zygote.py), which has imported torch and MONAI
    done = zygote.run_python(["-c", _HELP_CHECK, str(ROOT), *sorted(modules)], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {
        module: f"{r['code']}: {r['output'][-300:]}" for module, r in results.items()
        if r["code"] != 0 or not r["output"].strip()
    }  # fmt: skip
    assert not failed, "\n".join(f"{m} (shown in {modules[m]}): {why}" for m, why in failed.items())


def bundle_runs() -> list[tuple[str, list[str]]]:
    """``(page, arguments after 'run')`` of every ``monai.bundle run`` the pages show."""
    runs = []
    for page in PAGES:
        for words in commands(page):
            for module, arguments in python_modules(words):
                if module == "monai.bundle" and arguments[:1] == ["run"]:
                    runs.append((page.name, arguments[1:]))
    return runs


@cache
def merged_config(files: tuple[str, ...]):
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([str(ROOT / f) for f in files])
    return parser


def test_every_id_the_docs_pass_to_a_bundle_run_exists_in_its_configs():
    """Each ``--<id>`` (``a#b`` ids too) and each workflow name a documented ``monai.bundle run`` command gives is in
    the configs it layers: a renamed id fails here, not in a user's terminal."""
    runs = bundle_runs()
    assert len(runs) >= 10, runs
    missing = []
    _missing = object()
    for page, arguments in runs:
        options, positional, key = {}, [], None
        for word in arguments:
            if word in ("...", "…"):  # "and the rest of the command"
                continue
            if word.startswith("--"):
                key = word[2:]
                options[key] = None
            elif key is not None:
                options[key], key = word, None
            else:
                positional.append(word)
        if not options:  # the command named in prose ("it runs with `python -m monai.bundle run`")
            continue
        config = options.get("config_file")
        assert config, f"{page}: a monai.bundle run without --config_file: {arguments}"
        files = tuple(ast.literal_eval(config) if config.startswith("[") else [config])
        parser = merged_config(files)
        for name in positional[:1] + [k for k in options if k not in RUN_ARGUMENTS]:
            if parser.get(name, _missing) is _missing:
                missing.append(f"{page}: {name!r} is not an id of {list(files)}")
    assert not missing, "\n".join(missing)


PATH = re.compile(r"(?<![\w/.-])((?:\.ci|[A-Za-z_][\w-]*)/[\w.*<>/-]*|[\w-]+\.(?:md|txt|yml|yaml|toml|json|py|sh|def))")


def named_paths(page: Path) -> set[str]:
    lines, inline = code_of(page)
    found = set()
    for text in lines + inline:
        for match in PATH.findall(text):
            if not re.search(r"[<>{}…]|\.\.\.", match):
                found.add(match.rstrip("/.") + ("/" if match.endswith("/") else ""))
    return found


def test_every_repository_path_the_docs_name_exists():
    """A path whose first part is a folder or file of the repository (``configs/``, ``scripts/``, ``docs/``,
    ``tests/``, ``benchmarks/``, ``LICENSE``, ...) exists; paths under the folders a user makes are skipped; a
    dotted ``scripts.<module>`` is a module or package of the bundle."""
    top = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {"runs", "models"}
    missing = []
    for page in PAGES:
        for path in named_paths(page):
            first = path.split("/")[0]
            if path.startswith(USER_MADE) or (first not in top and "/" in path):
                continue
            if "/" not in path and path not in top:  # a bare file name: only the repository's top-level files
                continue
            if not glob.glob(str(ROOT / path.rstrip("/"))):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
        for module in set(re.findall(r"(?<![\w.])scripts(?:\.\w+)+", " ".join(code_of(page)[1]))):
            parts = module.split(".")
            if not any((ROOT.joinpath(*parts[:n]).with_suffix(".py")).exists() or ROOT.joinpath(*parts[:n]).is_dir()
                       for n in range(2, len(parts) + 1)):  # fmt: skip
                missing.append(f"{page.relative_to(ROOT)}: {module}")
    assert not missing, "\n".join(sorted(missing))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", page.read_text())
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{1,6} (.+)$", text, re.M)
    }


@pytest.mark.parametrize("page", PAGES + HISTORY, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_between_the_pages_resolves(page):
    """Each relative link of the page names a file of the repository and, after ``#``, a heading of that file."""
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_is_a_front_page_with_two_quick_start_commands():
    """At most 200 lines; the quick start holds two commands, the demo and the tests, and the tests' is the one CI
    runs after installing (``.ci/run``'s last line)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    blocks = [block.strip() for _, block in FENCE.findall(quick_start())]
    assert len(blocks) == 2, blocks
    demo, tests = blocks
    assert "configs/demo.yaml" in demo and demo.startswith("pip install")
    ci_test_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert tests.endswith(ci_test_command), (tests, ci_test_command)


def test_the_quick_start_quotes_the_times_measured_in_performance_md():
    """Each time the quick start gives is the one ``docs/performance.md``'s quick-start table holds (a number lives
    there; the README repeats only these two, and this keeps them the same)."""
    times = re.findall(r"\d+ min \d+ s", quick_start())
    assert len(times) == 2, times
    performance = (ROOT / "docs" / "performance.md").read_text()
    table = performance.split("### The quick start", 1)[1].split("\n### ", 1)[0]
    for time in times:
        assert time in table, f"the README quotes {time}, docs/performance.md's quick-start table does not"


def test_the_readme_links_the_requirements_page_before_its_quick_start_ends():
    """What the bundle needs and what has been tested is one click from the README's first screen."""
    readme = (ROOT / "README.md").read_text()
    first_screen = readme.split("\n## Quick start\n", 1)[0] + quick_start()
    assert "(docs/requirements.md" in first_screen
    table = readme.split("\n## Documentation\n", 1)[1]
    assert "[docs/requirements.md](docs/requirements.md)" in table


# files whose comments point to pages: the configs, the Docker files, the requirements files, pyproject.toml
POINTING = [*sorted((ROOT / "configs").glob("*.yaml")), ROOT / "Dockerfile", ROOT / "docker-compose.yml",
            *sorted(ROOT.glob("requirements*.txt")), ROOT / "pyproject.toml"]  # fmt: skip
# `README "Docker"`, `(README, "MONAI Label / 3D Slicer")`, `docs/training.md "Docker"`, `docs/monailabel.md, "Install"`
SECTION = re.compile(r'(?<![\w/.-])(README|(?:docs/)?[\w-]+\.md)(?:,\s*|\s+)"([^"]+)"')
PAGE = re.compile(r"(?<![\w/.-])(docs/[\w-]+\.md)(?:#([\w-]+))?")


def headings(page: Path) -> set[str]:
    return {h.strip().lower() for h in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M)}


def pointed_page(name: str, where: Path) -> Path:
    """The page a reference names: README is the repository's; ``x.md`` is beside the file, else under ``docs/``."""
    if name == "README":
        return ROOT / "README.md"
    for base in (ROOT, where.parent, ROOT / "docs"):
        if (base / name).is_file():
            return base / name
    return ROOT / name


def test_every_page_and_section_a_comment_or_page_points_to_exists():
    """A config's comment, the Docker files, the requirements files and the pages name pages (``docs/x.md``,
    ``docs/x.md#anchor``) and sections (``docs/training.md "Docker"``, ``README, "X"``): each page exists and each
    section is one of its headings, so a moved section fails here rather than sending a reader nowhere."""
    broken = []
    for path in POINTING + PAGES:
        text = path.read_text()
        # a page's fenced code is left out; a comment continued on the next line is one sentence
        text = FENCE.sub("", text) if path.suffix == ".md" else re.sub(r"\n[ \t]*#+[ \t]?", " ", text)
        text = re.sub(r"\s+", " ", text)
        where = path.relative_to(ROOT)
        for name, section in SECTION.findall(text):
            page = pointed_page(name, path)
            if not page.is_file():
                broken.append(f"{where}: {name} does not exist")
            elif section.strip().lower() not in headings(page):
                broken.append(f'{where}: {name} has no section "{section}"')
        if path.suffix == ".md":
            continue  # a page's own links are checked by test_every_link_between_the_pages_resolves
        for name, anchor in PAGE.findall(text):
            page = ROOT / name
            if not page.is_file():
                broken.append(f"{where}: {name} does not exist")
            elif anchor and anchor not in anchors(page):
                broken.append(f"{where}: {name} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


# (page, what the page says, the config that holds the value, {id: value}): a default the docs state in words
STATED_DEFAULTS = [
    ("docs/training.md", "| epochs | 300, validation every 5 (sliding window 96^3, overlap 0.25,", "train.yaml",
     {"max_epochs": 300, "val_interval": 5, "roi_size": [96, 96, 96], "sw_overlap": 0.25}),
    ("docs/README.md", "| epochs | 300, validation every 5 (sliding window 96^3, overlap 0.25,", "train.yaml",
     {"max_epochs": 300, "val_interval": 5, "roi_size": [96, 96, 96], "sw_overlap": 0.25}),
    ("docs/training.md", "| patch | 96 x 96 x 96 voxels, `num_samples` 4 per volume", "train.yaml",
     {"roi_size": [96, 96, 96], "displayable_configs#num_samples": 4}),
    ("docs/README.md", "| patch | 96 x 96 x 96 voxels, `num_samples` 4 per volume", "train.yaml",
     {"roi_size": [96, 96, 96], "displayable_configs#num_samples": 4}),
    ("docs/training.md", "| optimiser | AdamW, lr 1e-4, weight decay 1e-5, 5-epoch warm-up", "train.yaml",
     {"learning_rate": 1e-4, "weight_decay": 1e-5, "warmup_epochs": 5}),
    ("docs/README.md", "| optimiser | AdamW, lr 1e-4, weight decay 1e-5, 5-epoch warm-up", "train.yaml",
     {"learning_rate": 1e-4, "weight_decay": 1e-5, "warmup_epochs": 5}),
    ("docs/training.md", "| network | SwinUNETR, feature size 48", "train.yaml", {"feature_size": 48}),
    ("docs/training.md", "| preprocessing | RAS, 1 x 1 x 3 mm, crop to the body (HU > -500), HU window [-1000, 500]",
     "train.yaml", {"spacing": [1.0, 1.0, 3.0], "body_hu": -500, "hu_window": [-1000, 500]}),
    ("docs/training.md", "| `cache` | `auto` |", "train.yaml", {"cache": "auto"}),
    ("docs/training.md", "| `num_workers` | `auto` |", "train.yaml", {"num_workers": "auto"}),
    ("docs/training.md", "| `compile`, `compile_scope` | `auto`, `regional` |", "train.yaml",
     {"compile": "auto", "compile_scope": "regional"}),
    ("docs/training.md", "| `cuda_graphs` | `true` |", "train.yaml", {"cuda_graphs": True}),
    ("docs/training.md", "| `num_samples` | 4 |", "train.yaml", {"displayable_configs#num_samples": 4}),
    ("docs/training.md", "a small network (feature size 12), 8 epochs", "demo.yaml",
     {"feature_size": 12, "max_epochs": 8}),
    ("docs/data.md", "`split_seed` (0) in `train.yaml`", "train.yaml", {"split_seed": 0}),
    ("docs/data.md", "`test_fraction` (10 %) test, `val_fraction` (20 %) validation, the rest training in `num_folds` "
     "(5) folds", "train.yaml", {"test_fraction": 0.1, "val_fraction": 0.2, "num_folds": 5}),
    ("docs/monailabel.md", "`batch_size` (1) volume x `num_samples` (4) patches", "train.yaml",
     {"batch_size": 1, "displayable_configs#num_samples": 4}),
    ("docs/monailabel.md", "validation runs every `val_interval` (5) epochs", "train.yaml", {"val_interval": 5}),
    ("docs/inference.md", "a volume above `max_volume_ml` (1000 ml), more than `max_components` separate pieces (10), "
     "or filling more than `max_border_fraction` (50 %)", "inference.yaml",
     {"plausible_gtv#max_volume_ml": 1000, "plausible_gtv#max_components": 10,
      "plausible_gtv#max_border_fraction": 0.5}),
    ("docs/inference.md", "grown by `roi_region_margin_mm` (30 mm in plane, 40 mm above and below)", "train.yaml",
     {"roi_region_margin_mm": [30, 30, 40]}),
    ("docs/evaluation.md", "`surface_dice_tolerance_mm` (3 mm, one slice thickness)", "train.yaml",
     {"surface_dice_tolerance_mm": 3.0}),
    ("docs/evaluation.md", "`tta_axes` (default `[0,1,2]`", "train.yaml", {"tta_axes": [0, 1, 2]}),
    ("docs/profiling.md", "8 with the default `[2, 2, 4, 1]`", "profile.yaml", {"profiler_schedule": [2, 2, 4, 1]}),
]  # fmt: skip


@pytest.mark.parametrize("page, words, config, values", STATED_DEFAULTS, ids=lambda v: v if isinstance(v, str) else "")
def test_each_default_a_page_states_is_the_configs(page, words, config, values):
    """The page says the words, and the config holds each value they state: a default changed in a config (or in the
    words) fails here until both agree."""
    import yaml

    text = re.sub(r"\s+", " ", (ROOT / page).read_text())
    assert re.sub(r"\s+", " ", words) in text, f"{page} no longer says: {words}"
    content = yaml.safe_load((ROOT / "configs" / config).read_text())
    for key, value in values.items():
        held = content
        for part in key.split("#"):
            held = held[part]
        assert held == value, f"{page} says {key} is {value!r}; configs/{config} holds {held!r}"


def test_num_workers_auto_on_a_cpu_is_the_usable_cpus_less_one_at_most_4(monkeypatch):
    """docs/training.md: ``num_workers: auto`` is the usable CPUs less one, at most 4 on a CPU (not on a GPU)."""
    import scripts.data.dataset

    text = re.sub(r"\s+", " ", (ROOT / "docs" / "training.md").read_text())
    assert "the usable CPUs less one, at most 4 on a CPU" in text
    monkeypatch.setattr(scripts.data.dataset, "usable_cpus", lambda: 64)
    assert scripts.data.dataset.loader_workers("auto", "cpu") == 4
    assert scripts.data.dataset.loader_workers("auto", "cuda") == 63
    monkeypatch.setattr(scripts.data.dataset, "usable_cpus", lambda: 3)
    assert scripts.data.dataset.loader_workers("auto", "cpu") == 2


def test_the_gpu_kits_budget_is_the_one_the_readme_states():
    """The README: the kit's ``--budget_s`` is 450 s by default (read from ``benchmarks/gpu_proof.py``'s ``main``)."""
    tree = ast.parse((ROOT / "benchmarks" / "gpu_proof.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    names = [a.arg for a in main.args.args]
    defaults = dict(zip(names[len(names) - len(main.args.defaults) :], main.args.defaults))
    budget = ast.literal_eval(defaults["budget_s"])
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    assert f"`--budget_s`, {budget:g} s by default" in readme
