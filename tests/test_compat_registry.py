"""The compat registry: gating, idempotent apply, exact revert, deferred patches, the table, the CLI."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from compat_fixtures import targets

import compat
from compat import registry
from compat.core import Patch, Patcher, PatchUnavailable
from compat.patches import UPSTREAM_PACKAGE
from ddtree.errors import ConfigError

TESTS = Path(__file__).resolve().parent
MISSING = object()


@pytest.fixture(autouse=True)
def _clean_registry():
    compat.revert()
    yield
    compat.revert()


def versions(**installed):
    """A fake installed-version lookup: versions(transformers="5.24.0"); unnamed packages are absent."""
    return lambda dist: installed.get(dist)


def greet_patch(pid="greet-loud", spec=">=5.0", condition=None, imports=(), fail=None):
    def install(patcher: Patcher, module):
        if fail is not None:
            patcher.wrap(targets, "greet", lambda w, i, a, k: "half-installed")
            raise fail
        owner = module if module is not None else targets
        patcher.wrap(
            owner, "greet" if module is None else "answer", lambda w, i, a, k: str(w(*a, **k)).upper()
        )
        return "loud"

    return Patch(
        pid,
        ("compat_fixtures.targets:greet",),
        {"transformers": spec},
        "test patch",
        install,
        condition=condition,
        condition_doc="test condition",
        imports=imports,
    )


# --------------------------------------------------------------------------- version gating


def test_version_gating_in_range_applies():
    original = targets.greet
    [entry] = compat.apply(patches=[greet_patch()], version_of=versions(transformers="5.24.0"))
    assert entry["status"] == "applied" and entry["detail"] == "loud"
    assert targets.greet() == "HELLO WORLD"
    compat.revert()
    assert targets.greet is original


def test_version_gating_out_of_range_is_skipped():
    [entry] = compat.apply(
        patches=[greet_patch(spec=">=5.0,<5.20")], version_of=versions(transformers="5.24.0")
    )
    assert entry["status"] == "skipped-version"
    assert "5.24.0" in entry["detail"] and "<5.20" in entry["detail"]
    assert targets.greet() == "hello world"


def test_version_gating_package_absent_is_skipped():
    [entry] = compat.apply(patches=[greet_patch()], version_of=versions())
    assert entry["status"] == "skipped-absent" and "transformers is not installed" in entry["detail"]
    assert targets.greet() == "hello world"


def test_version_gating_counts_prereleases_and_every_package():
    assert registry.gate(greet_patch(spec=">=5.24"), versions(transformers="5.25.0.dev0")) is None
    both = Patch("p", ("x:y",), {"transformers": ">=5.0", "torch": ">=2.4"}, "r", lambda p, m: None)
    assert registry.gate(both, versions(transformers="5.24.0", torch="2.13.0")) is None
    assert registry.gate(both, versions(transformers="5.24.0", torch="2.1.0"))[0] == "skipped-version"
    assert registry.gate(both, versions(transformers="5.24.0"))[0] == "skipped-absent"


def test_version_gating_of_the_real_table():
    """Every transformers patch is ruled out on 4.x and without transformers; the lookup is injectable."""
    old = {
        e["id"]: e["status"] for e in compat.apply(version_of=versions(transformers="4.40.0", torch="2.13.0"))
    }
    for patch in compat.PATCHES:
        if "transformers" in patch.versions:
            assert old[patch.id] == "skipped-version", patch.id
    compat.revert()
    gone = {e["id"]: e["status"] for e in compat.apply(version_of=versions())}
    assert set(gone.values()) == {"skipped-absent"}


def test_apply_reports_the_installed_versions_by_default():
    entries = compat.apply(skip=[p.id for p in compat.PATCHES if p.id != "cache-crop-absolute"])
    crop = next(e for e in entries if e["id"] == "cache-crop-absolute")
    assert crop["status"] == "applied"  # transformers 5.24 in this venv


# --------------------------------------------------------------------------- statuses and selection


def test_only_and_skip_mark_skipped_config():
    rows = [greet_patch("a"), greet_patch("b")]
    entries = {
        e["id"]: e["status"]
        for e in compat.apply(only=["a"], patches=rows, version_of=versions(transformers="5.1"))
    }
    assert entries == {"a": "applied", "b": "skipped-config"}
    compat.revert()
    entries = {
        e["id"]: e["status"]
        for e in compat.apply(skip=["a", "b"], patches=rows, version_of=versions(transformers="5.1"))
    }
    assert entries == {"a": "skipped-config", "b": "skipped-config"}


def test_unknown_ids_and_engine_are_a_config_error():
    with pytest.raises(ConfigError, match=r"compat.only: unknown patch id\(s\) \['nope'\]") as err:
        compat.apply(only=["nope"])
    assert err.value.setting == "compat.only" and "cache-crop-absolute" in err.value.fix
    with pytest.raises(ConfigError, match="compat.skip"):
        compat.apply(skip=["cache-crop-absolute", "typo"])
    with pytest.raises(ConfigError, match="engine: unknown engine 'fast'"):
        compat.apply(engine="fast")


def test_condition_false_is_skipped_condition():
    [entry] = compat.apply(
        patches=[greet_patch(condition=lambda: False)], version_of=versions(transformers="5.1")
    )
    assert entry["status"] == "skipped-condition" and "test condition" in entry["detail"]


def test_failed_install_leaves_nothing_behind():
    original = targets.greet
    [entry] = compat.apply(
        patches=[greet_patch(fail=RuntimeError("boom"))], version_of=versions(transformers="5.1")
    )
    assert entry["status"] == "failed" and entry["detail"] == "RuntimeError: boom"
    assert targets.greet is original
    assert compat.failures([entry]) == [entry]


def test_unavailable_target_is_skipped_absent():
    [entry] = compat.apply(
        patches=[greet_patch(fail=PatchUnavailable("no such class"))], version_of=versions(transformers="5.1")
    )
    assert entry["status"] == "skipped-absent" and entry["detail"] == "no such class"


def test_apply_is_idempotent_and_revert_is_exact():
    original = targets.greet
    compat.apply(patches=[greet_patch()], version_of=versions(transformers="5.1"))
    wrapped = targets.greet
    again = compat.apply(patches=[greet_patch()], version_of=versions(transformers="5.1"))
    assert targets.greet is wrapped and targets.greet() == "HELLO WORLD"  # not wrapped twice
    assert again[0]["status"] == "applied"
    assert compat.revert() == ["greet-loud"]
    assert targets.greet is original and compat.report([greet_patch()]) == []


def test_copies_made_while_patched_follow_the_patch_state():
    """`from x import f` while patched keeps the wrapper; it acts only while the patch is applied."""
    compat.apply(patches=[greet_patch()], version_of=versions(transformers="5.1"))
    copy = targets.greet
    assert copy() == "HELLO WORLD"
    compat.revert()
    assert copy() == "hello world" and targets.greet is not copy
    compat.apply(patches=[greet_patch()], version_of=versions(transformers="5.1"))
    assert copy() == "HELLO WORLD" and targets.greet() == "HELLO WORLD"


def test_patcher_restores_items_attributes_and_absent_names():
    box_dict_before = dict(vars(targets.Box))
    p = Patcher("t")
    p.set_item(targets.REGISTRY, "greet", None)
    p.set_item(targets.REGISTRY, "new", 1)
    p.set_attr(targets.Box, "extra", 3)
    # __repr__ is inherited: revert must delete it from Box, not copy object.__repr__ into Box
    p.wrap(targets.Box, "__repr__", lambda w, i, a, k: "<box>")
    assert repr(targets.Box()) == "<box>" and targets.Box.extra == 3
    p.undo()
    assert targets.REGISTRY == {"greet": targets.greet}
    assert vars(targets.Box) == box_dict_before and all(
        vars(targets.Box)[k] is v for k, v in box_dict_before.items()
    )


# --------------------------------------------------------------------------- deferred (post-import) patches


def _late_patch():
    return greet_patch("late-loud", imports=("compat_fixtures.late_target",))


def test_deferred_patch_waits_for_import_then_reverts():
    sys.modules.pop("compat_fixtures.late_target", None)
    [entry] = compat.apply(patches=[_late_patch()], version_of=versions(transformers="5.1"))
    assert entry["status"] == "pending"
    late = importlib.import_module("compat_fixtures.late_target")
    assert late.answer() == "41"
    [entry] = compat.report([_late_patch()])
    assert entry["status"] == "applied" and entry["detail"].startswith("compat_fixtures.late_target: loud")
    compat.revert()
    assert late.answer() == 41 and "answer" in vars(late) and not hasattr(late.answer, "__wrapped__")


def test_deferred_patch_reverted_before_import_never_fires():
    sys.modules.pop("compat_fixtures.late_target", None)
    compat.apply(patches=[_late_patch()], version_of=versions(transformers="5.1"))
    compat.revert()
    late = importlib.import_module("compat_fixtures.late_target")
    assert late.answer() == 41


def test_deferred_patch_follows_a_reimported_module():
    sys.modules.pop("compat_fixtures.late_target", None)
    importlib.import_module("compat_fixtures.late_target")
    compat.apply(patches=[_late_patch()], version_of=versions(transformers="5.1"))
    sys.modules.pop("compat_fixtures.late_target")
    [entry] = compat.apply(patches=[_late_patch()], version_of=versions(transformers="5.1"))
    assert entry["status"] == "pending"  # the module it patched is gone: registered again
    fresh = importlib.import_module("compat_fixtures.late_target")
    assert fresh.answer() == "41"


# --------------------------------------------------------------------------- layering, engines, providers


def test_import_compat_loads_no_engine_and_no_torch():
    """core, patches and registry import nothing heavy, and never the ddtree engine (the layering rule)."""
    code = ("import sys, compat, compat.__main__; "
            "bad = sorted(m for m in sys.modules if m.startswith(('ddtree.engine', 'ddtree.pipeline', 'torch', "
            "'transformers'))); print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_table_is_declared_at_import_and_its_gdn_tree_forward_row_matches_the_engine():
    """The GDN class patch is a row (listed by python -m compat) whose wrapper the engine provides; its targets and
    version range are the engine's, and apply/revert through the registry restore the original forwards."""
    assert registry.PATCHES is compat.PATCHES and len({p.id for p in compat.PATCHES}) == len(compat.PATCHES)
    from compat.patches import gdn_tree_forward, upstream_gdn_tree
    from ddtree.engine import gdn

    assert gdn_tree_forward.TARGETS == tuple(f"{m}:{q}" for m, q in gdn.TARGETS)
    assert gdn_tree_forward.VERSIONS == gdn.VERSIONS == upstream_gdn_tree.VERSIONS
    classes = gdn.target_classes()
    originals = {cls: vars(cls)["forward"] for cls in classes}
    compat.revert()
    assert {e["id"]: e["status"] for e in compat.apply()}["gdn-tree-forward"] == "skipped-absent"  # no provider
    assert gdn.install() == [c.__name__ for c in classes] and gdn.is_installed()
    assert all(vars(c)["forward"] is not originals[c] for c in classes)
    gdn.install()  # idempotent: wrapped once
    assert all(vars(c)["forward"].__wrapped__ is originals[c] for c in classes)
    assert "gdn-tree-forward" in compat.revert()
    assert not gdn.is_installed() and all(vars(c)["forward"] is originals[c] for c in classes)


NATIVE_ROWS = {"flash-s-aux", "sliding-window", "gdn-tree-forward"}  # fixes of transformers itself, for any code


def test_each_row_names_its_engines_and_native_applies_only_its_own():
    assert {p.id for p in compat.PATCHES if "native" in p.for_engines} == NATIVE_ROWS
    assert all("upstream" in p.for_engines for p in compat.PATCHES)
    from transformers import PreTrainedModel

    def call_wrapped() -> bool:  # PreTrainedModel inherits nn.Module.__call__ until a patch wraps it
        return "__call__" in vars(PreTrainedModel)

    assert not call_wrapped()
    native = {e["id"]: e["status"] for e in compat.apply(engine="native")}
    assert {i for i, st in native.items() if st != "skipped-engine"} == NATIVE_ROWS
    assert not call_wrapped()  # cache-kwarg / hybrid-cache stay off the native engine's forwards
    upstream = {e["id"]: e["status"] for e in compat.apply(engine="upstream")}  # adds the authors' rows
    assert upstream["cache-kwarg"] == upstream["hybrid-cache-config"] == "applied"
    assert call_wrapped()
    compat.revert()
    assert not call_wrapped()
    everything = {e["id"]: e["status"] for e in compat.apply()}  # no engine: every row (python -m compat)
    assert "skipped-engine" not in everything.values()
    with pytest.raises(ValueError, match="for_engines"):
        Patch("x", (), {}, "r", lambda p, m: None, for_engines=frozenset({"vllm"}))


def test_a_row_that_needs_a_provider_gets_it_from_apply():
    seen = []

    def install(patcher, module):
        seen.append(patcher.provided["thing"])
        return "used it"

    row = Patch("needs-thing", ("compat_fixtures.targets:Box",), {}, "test", install, needs=("thing",))
    [entry] = compat.apply(patches=[row], version_of=versions())
    assert entry["status"] == "skipped-absent" and "needs thing" in entry["detail"] and not seen
    [entry] = compat.apply(patches=[row], version_of=versions(), provided={"thing": 42, "other": 1})
    assert entry["status"] == "applied" and seen == [42]


# --------------------------------------------------------------------------- the real table


def _locate(target: str):
    """(container, key, is_item) for "module:Qual.name" or "module:Qual.name['key']"; None if not importable."""
    module, _, qual = target.partition(":")
    key = None
    if m := re.fullmatch(r"(.*)\['(.+)'\]", qual):
        qual, key = m.groups()
    if module.startswith(UPSTREAM_PACKAGE):
        return None  # the authors' modules: covered by test_compat_upstream
    owner = importlib.import_module(module)
    *path, name = qual.split(".")
    for part in path:
        owner = getattr(owner, part)
    if key is not None:
        return getattr(owner, name), key, True
    return owner, name, False


def _snapshot():
    snap = {}
    for patch in compat.PATCHES:
        for target in patch.targets:
            located = _locate(target)
            if located is None:
                continue
            container, key, is_item = located
            value = container.get(key, MISSING) if is_item else vars(container).get(key, MISSING)
            snap[target] = (value, dict(vars(value)) if isinstance(value, type) else None)
    return snap


def test_round_trip_leaves_every_target_identical():
    before = _snapshot()
    entries = compat.apply()
    assert not compat.failures(entries), entries
    during = _snapshot()
    changed = [t for t in before if during[t][0] is not before[t][0]]
    assert "transformers.cache_utils:Cache.crop" in changed
    assert "transformers.modeling_utils:AttentionInterface._global_mapping['sdpa']" in changed
    assert compat.apply() == entries  # idempotent: same report, same objects
    assert all(_snapshot()[t][0] is during[t][0] for t in during)
    compat.revert()
    after = _snapshot()
    for target, (value, class_dict) in before.items():
        assert after[target][0] is value, target
        if class_dict is not None:
            now = after[target][1]
            assert now.keys() == class_dict.keys() and all(now[k] is v for k, v in class_dict.items()), target


def test_table_rows_are_well_formed():
    from packaging.specifiers import SpecifierSet

    ids = [p.id for p in compat.PATCHES]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", i) for i in ids)
    for patch in compat.PATCHES:
        assert patch.targets and all(":" in t for t in patch.targets), patch.id
        assert patch.reason and "\n" not in patch.reason and len(patch.reason) <= 200, patch.id
        for spec in patch.versions.values():
            SpecifierSet(spec)


def test_every_patch_has_a_test():
    """A patch id `some-id` needs a test function whose name contains `some_id` in tests/test_compat*.py."""
    names = set()
    for path in TESTS.glob("test_compat*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(node.name)
    untested = [p.id for p in compat.PATCHES if not any(p.id.replace("-", "_") in n for n in names)]
    assert not untested, f"patches without a test: {untested}"


def test_report_tags_and_statuses_are_stable():
    assert compat.STATUSES == (
        "applied",
        "pending",
        "skipped-version",
        "skipped-absent",
        "skipped-config",
        "skipped-engine",
        "skipped-condition",
        "failed",
    )
    entries = compat.apply(patches=[greet_patch()], version_of=versions(transformers="5.1"))
    assert compat.as_tags(entries) == {"compat.greet-loud": "applied"}
    assert set(entries[0]) == {
        "id",
        "target",
        "targets",
        "versions",
        "engines",
        "condition",
        "reason",
        "status",
        "detail",
    }


# --------------------------------------------------------------------------- python -m compat


def test_cli_prints_the_table_and_reverts(capsys):
    from compat.__main__ import main

    assert main([]) == 0
    out = capsys.readouterr().out
    for patch in compat.PATCHES:
        assert patch.id in out
    assert "cache-crop-absolute  applied" in out.replace("   ", "  ")
    assert compat.report() == []  # the CLI reverts what it applied


def test_cli_check_fails_on_a_failed_patch(monkeypatch, capsys):
    from compat.__main__ import main

    broken = greet_patch("always-broken", spec=">=0", fail=RuntimeError("kaput"))
    monkeypatch.setattr(registry, "PATCHES", (broken,))
    assert main([]) == 0
    assert main(["--check"]) == 1
    assert "always-broken" in capsys.readouterr().err
    assert main(["--check", "--skip", "always-broken"]) == 0
    assert main(["--only", "nope"]) == 2
