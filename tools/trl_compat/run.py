#!/usr/bin/env python
"""Run TRL's GRPO test file against trl.GRPOTrainer and JetGRPOTrainer, offline, and diff the outcomes.

    python tools/trl_compat/run.py /path/to/trl/tests [--runs trl,unified,baseline] [--out DIR] [-- PYTEST ARGS]

Runs, each a separate pytest process over ``<tests>/test_grpo_trainer.py`` with this folder's plugin:
  trl       the reference: trl.GRPOTrainer / trl.GRPOConfig
  unified   JET=1 JET_STRATEGY=unified   (train fp8, rollout fp8, corrector none)
  baseline  JET=1 JET_STRATEGY=baseline  (train bf16, rollout fp8, corrector tis)

Writes, under --out: ``<run>.xml`` (junit), ``<run>.log`` (pytest output), ``<run>.json`` (outcome
per test + run metadata) and ``report.md`` (counts, and every test that passes with TRL but not
with Jet, with its error's first line and the frames in the jetrl-trainer sources). ``--report-only``
rebuilds report.md from existing json/xml files. The stand-ins are built first when missing
(build_standins.py; needs PyPI for one ``pip download dashscope``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
JET_ROOT = HERE.parent.parent  # the jetrl-trainer checkout this harness lives in
RUNS = {
    "trl": {},
    "unified": {"JET": "1", "JET_STRATEGY": "unified"},
    "baseline": {"JET": "1", "JET_STRATEGY": "baseline"},
}
TEST_FILE = "test_grpo_trainer.py"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(JET_ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def jet_revision() -> dict:
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("log", "--oneline", "-1"), "dirty_tracked_files": dirty.splitlines() if dirty != "?" else []}


def snapshot_jet(rev: str, out: Path) -> tuple[Path, dict]:
    """Install commit ``rev`` of this checkout (``git archive``, no working-tree edits) into ``out``/jet_<hash>/site.

    The Jet runs put that folder first on PYTHONPATH, ahead of the editable install, so they test one
    commit even while the checkout is being edited.
    """
    commit = _git("rev-parse", rev)
    if commit == "?":
        raise SystemExit(f"cannot resolve {rev!r} in {JET_ROOT}")
    root = out / f"jet_{commit[:10]}"
    site = root / "site"
    if not (site / "jetrl_trainer" / "__init__.py").exists():
        src = root / "src"
        src.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(JET_ROOT), "archive", commit], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(src)], check=True)
        # Older commits' setup.py missed some subpackages of jetrl_trainer/ in a non-editable install (the
        # editable one finds them): copy what the wheel left out, and say so.
        import shutil

        filled = []
        for path in sorted((src / "jetrl_trainer").rglob("*.py")):
            target = site / path.relative_to(src)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
                filled.append(str(path.relative_to(src)))
        (root / "filled_in.txt").write_text("".join(f + "\n" for f in filled))
    filled = (root / "filled_in.txt").read_text().split() if (root / "filled_in.txt").exists() else []
    info = {"source": f"snapshot of {rev}", "commit": _git("log", "--oneline", "-1", commit), "site": str(site)}
    if filled:
        info["files_missing_from_the_wheel_copied_in"] = filled
        print(f"note: the wheel of {commit[:10]} lacked {len(filled)} files of jetrl_trainer/; copied them in")
    return site, info


def run_env(cache: Path, extra: dict, vocab: str = "compact", jet_site: Path | None = None,
            score_valid_only: bool = False) -> dict:
    env = dict(os.environ)
    for key in ("JET", "JET_STRATEGY"):
        env.pop(key, None)
    env.update(
        HF_HOME=str(cache / "hf_home"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_DISABLED="true",
        TRL_COMPAT_CACHE=str(cache),
        TRL_COMPAT_VOCAB=vocab,
        PYTHONPATH=os.pathsep.join([str(HERE), *([str(jet_site)] if jet_site else []),
                                    env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.pop("HF_HUB_CACHE", None)
    env.pop("TRL_COMPAT_SCORE_VALID_ONLY", None)
    if score_valid_only:
        env["TRL_COMPAT_SCORE_VALID_ONLY"] = "1"
    if vocab == "full":
        env["HF_HUB_CACHE"] = str(cache / "hf_home" / "hub_full")
    env.update(extra)
    return env


def have_timeout_plugin() -> bool:
    import importlib.util

    return importlib.util.find_spec("pytest_timeout") is not None


def collect_ids(tests: Path, cache: Path, out: Path, vocab: str) -> list[str]:
    """Test ids (``Class::name[params]``) the plugin keeps, in collection order."""
    cmd = [sys.executable, "-m", "pytest", str(tests / TEST_FILE), "-p", "trl_compat_plugin", "-p", "no:cacheprovider",
           "--collect-only", "-q"]
    proc = subprocess.run(cmd, cwd=out, env=run_env(cache, {}, vocab), capture_output=True, text=True)
    ids = [line.split(TEST_FILE + "::", 1)[1] for line in proc.stdout.splitlines() if TEST_FILE + "::" in line]
    if not ids:
        raise SystemExit(f"collection failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return ids


def is_timeout(result: dict) -> bool:
    return result["outcome"] in ("failed", "error") and "Timeout (>" in result["text"] + result["message"]


def start_run(name: str, tests: Path, out: Path, cache: Path, timeout: int, threads: int, pytest_args: list[str],
              vocab: str = "compact", jet: tuple[Path, dict] | None = None, score_valid_only: bool = False,
              resume: Path | None = None, rerun: tuple[str, ...] = (), all_ids: list[str] | None = None):
    """Start one pytest process; returns a function that waits for it and writes ``<name>.json``.

    ``resume``: a results folder of an earlier (interrupted) run; only the tests it lacks, those it lost to the
    timeout and those named in ``rerun`` run now, and ``<name>.json`` holds the earlier results updated with these.
    """
    previous = {}
    targets = [str(tests / TEST_FILE)]
    if resume is not None and (resume / f"{name}.json").exists():
        previous = json.loads((resume / f"{name}.json").read_text())
        done = previous["tests"]
        todo = [t for t in all_ids if t not in done or is_timeout(done[t]) or t in rerun]
        if not todo:
            print(f"[{name}] nothing left to run")
            return lambda: previous
        targets = [f"{tests / TEST_FILE}::{t}" for t in todo]
    workdir = out / f"{name}_cwd"  # trainers built with args=None write "<model>-GRPO/" into the cwd
    workdir.mkdir(parents=True, exist_ok=True)
    xml = out / f"{name}.xml"
    if xml.exists():
        xml.unlink()
    cmd = [sys.executable, "-m", "pytest", *targets, "-p", "trl_compat_plugin", "-p", "no:cacheprovider",
           "-o", "junit_logging=no", f"--junitxml={xml}", "--tb=short", "-rfE", "-v", "--durations=0",
           f"--basetemp={workdir / 'tmp'}"]
    if timeout and have_timeout_plugin():
        cmd.append(f"--timeout={timeout}")
    cmd += pytest_args
    jet_site = jet[0] if jet and name != "trl" else None
    env = run_env(cache, RUNS[name], vocab, jet_site, score_valid_only)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    meta = {"run": name, "env": RUNS[name], "cmd": cmd, "threads": threads or None, "vocab": vocab,
            "score_valid_only": score_valid_only,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if name != "trl":
        meta["jet"] = dict(jet[1]) if jet else {"source": "working tree (editable install)", **jet_revision()}
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)

    def finish() -> dict:
        proc.wait()
        log.close()
        meta.update(returncode=proc.returncode, seconds=round(time.time() - t0, 1))
        if name != "trl" and not jet:
            meta["jet_after"] = jet_revision()  # the library is edited concurrently: did it move during the run?
        meta["tests"] = parse_junit(xml) if xml.exists() else {}
        if previous:
            fresh = meta["tests"]
            meta["tests"] = {**previous["tests"], **fresh}
            meta["phases"] = [*previous.get("phases", [_phase(previous)]), _phase(meta, len(fresh))]
            meta["seconds"] = round(sum(p["seconds"] for p in meta["phases"]), 1)
        (out / f"{name}.json").write_text(json.dumps(meta, indent=1))
        print(f"[{name}] rc={proc.returncode} {meta['seconds']}s {count(meta['tests'])}", flush=True)
        return meta

    return finish


def _phase(meta: dict, n: int | None = None) -> dict:
    keep = ("started", "seconds", "returncode", "vocab", "score_valid_only", "threads")
    return {**{k: meta.get(k) for k in keep}, "tests_run": len(meta["tests"]) if n is None else n}


# ----------------------------------------------------------------------------- junit parsing


def parse_junit(xml: Path) -> dict:
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "").split(".")[-1]
        test_id = f"{cls}::{case.get('name')}" if cls and not cls.startswith("test_") else case.get("name")
        outcome, message, text = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = child.get("type", "")
                message, text = child.get("message", ""), child.text or ""
                if child.tag == "skipped":
                    outcome = "xfailed" if kind == "pytest.xfail" else "skipped"
                else:
                    outcome = "failed" if child.tag == "failure" else "error"
                break
        if outcome == "passed" and any(p.get("name") == "xpass" for p in case.iter("property")):
            outcome = "xpassed"
        results[test_id] = {"outcome": outcome, "message": message, "text": text, "time": float(case.get("time", 0))}
    return results


def count(tests: dict) -> dict:
    counts: dict[str, int] = {}
    for r in tests.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return dict(sorted(counts.items()))


FRAME = re.compile(r"^(?P<path>\S+?\.py):(?P<line>\d+): in (?P<func>\S+)", re.M)


def first_line(result: dict) -> str:
    text = result["text"]
    errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if errors:
        return errors[0]
    return (result["message"].splitlines() or [""])[0]


def jet_frames(result: dict, site: str | None = None) -> list[str]:
    """Traceback frames in the jetrl-trainer sources (an installed snapshot's jetrl_trainer/, or this checkout)."""
    frames = []
    for m in FRAME.finditer(result["text"]):
        path = m.group("path").replace(os.sep, "/")
        if "/jetrl_trainer/" in "/" + path:
            where = "jetrl_trainer/" + ("/" + path).split("/jetrl_trainer/", 1)[1]
        elif path.startswith(str(JET_ROOT) + "/") and not path.startswith(str(HERE) + "/"):
            where = os.path.relpath(path, JET_ROOT)
        else:
            continue
        frames.append(f"{where}:{m.group('line')} in {m.group('func')}")
    return frames


def report(out: Path, names: list[str]) -> str:
    metas = {n: json.loads((out / f"{n}.json").read_text()) for n in names if (out / f"{n}.json").exists()}
    lines = ["# TRL GRPO tests: trl.GRPOTrainer vs JetGRPOTrainer", ""]
    lines += ["| run | settings | vocab | jetrl commit | seconds | passed | failed | error | skipped | xfailed | xpassed |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, m in metas.items():
        c = count(m["tests"])
        commit = m.get("jet", {}).get("commit", "-")
        commit = commit if len(commit) <= 70 else commit[:67] + "..."
        after = m.get("jet_after", {}).get("commit", commit)
        if after[:7] != commit[:7]:
            commit += f" (moved to {after[:7]} during the run)"
        if m.get("jet", {}).get("dirty_tracked_files"):
            commit += " (working tree, with uncommitted changes)"
        settings = ", ".join(f"{k}={v}" for k, v in m["env"].items()) or "trl"
        phases = m.get("phases") or [_phase(m)]
        if any(p.get("score_valid_only") for p in phases):
            settings += ", score-valid-only" + (" (some phases)" if not all(p.get("score_valid_only") for p in phases) else "")
        if len(phases) > 1:
            settings += f", {len(phases)} phases (" + " + ".join(str(p["tests_run"]) for p in phases) + " tests)"
        lines.append(f"| {n} | {settings} | {m.get('vocab', '?')} | {commit} | {m['seconds']} | " + " | ".join(
            str(c.get(k, 0)) for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")) + " |")
    ref = metas.get("trl", {}).get("tests", {})
    for n, m in metas.items():
        if n == "trl":
            continue
        broken = [t for t, r in ref.items() if r["outcome"] in ("passed", "xfailed") and t in m["tests"]
                  and m["tests"][t]["outcome"] != r["outcome"]]
        not_run = [t for t in ref if t not in m["tests"]]
        fixed = [t for t, r in m["tests"].items() if r["outcome"] == "passed"
                 and ref.get(t, {}).get("outcome") not in (None, "passed")]
        lines += ["", f"## {n}: {len(broken)} tests pass with TRL and not with Jet", ""]
        if not_run:
            lines += [f"({len(not_run)} tests of the TRL run did not run in this one.)", ""]
        if broken:
            lines += ["| test | TRL | Jet | error (first line) | jetrl-trainer frames |", "| --- | --- | --- | --- | --- |"]
            for t in broken:
                r = m["tests"].get(t, {"outcome": "missing", "message": "", "text": ""})
                msg = first_line(r).replace("|", "\\|")[:300]
                frames = "<br>".join(jet_frames(r, m.get("jet", {}).get("site"))) or "-"
                lines.append(f"| `{t}` | {ref[t]['outcome']} | {r['outcome']} | {msg} | {frames} |")
        if fixed:
            lines += ["", f"Pass with Jet but not with TRL ({len(fixed)}): " + ", ".join(f"`{t}`" for t in fixed)]
    ref_bad = [t for t, r in ref.items() if r["outcome"] in ("failed", "error")]
    if ref_bad:
        lines += ["", f"## Fail with TRL itself ({len(ref_bad)}; not counted)", ""]
        lines += [f"- `{t}`: {first_line(ref[t])[:200]}" for t in ref_bad]
    everything = list(dict.fromkeys(t for m in metas.values() for t in m["tests"]))
    if everything:
        lines += ["", "## Every test", "", "| test | " + " | ".join(metas) + " |", "| --- |" + " --- |" * len(metas)]
        for t in everything:
            lines.append(f"| `{t}` | " + " | ".join(m["tests"].get(t, {}).get("outcome", "-") for m in metas.values()) + " |")
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="a TRL checkout's tests/ folder (holding test_grpo_trainer.py)")
    parser.add_argument("--runs", default="trl,unified,baseline", help="comma-separated subset of trl,unified,baseline")
    parser.add_argument("--out", type=Path, default=Path("/tmp/trl_compat_out"), help="results folder")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("TRL_COMPAT_CACHE", "/tmp/trl_compat_cache")),
                        help="stand-ins folder (built when missing)")
    parser.add_argument("--timeout", type=int, default=900, help="per-test timeout, seconds (pytest-timeout; 0 = none)")
    parser.add_argument("--vocab", choices=("compact", "full"), default="compact",
                        help="compact: full-size vocabularies only for the tests that hard-code Qwen ids (fast); "
                             "full: every test on the full-size stand-ins (faithful, slow)")
    parser.add_argument("--jet-rev", default="HEAD",
                        help="commit of this checkout the Jet runs test, installed from git archive into --out "
                             "(default HEAD); 'worktree' tests the editable install as it is")
    parser.add_argument("--score-valid-only", action="store_true",
                        help="speed-up: TRL's fused lm_head log-probs over completion positions only on CPU too "
                             "(same values; see the plugin's _patch_score_valid_only)")
    parser.add_argument("--resume", type=Path, default=None,
                        help="results folder of an interrupted run: run only what it lacks or lost to the timeout, "
                             "and write merged results to --out")
    parser.add_argument("--rerun", action="append", default=[],
                        help="with --resume: a test id (Class::name[params]) to run again; repeatable")
    parser.add_argument("--parallel", action="store_true", help="start the runs at once instead of one after another")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for each run (0 = leave as is)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild report.md from the json files")
    argv = sys.argv[1:]
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser.epilog = "Extra pytest arguments go after --, e.g.  run.py TESTS --runs trl -- -k test_train"
    args = parser.parse_args(argv)
    args.pytest_args = pytest_args
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = set(names) - set(RUNS)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; choose from {list(RUNS)}")
    out, cache, tests = args.out.resolve(), args.cache.resolve(), args.tests.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        if not (tests / TEST_FILE).exists():
            parser.error(f"{tests / TEST_FILE} not found")
        for p in (out, cache):
            if str(p).startswith(str(JET_ROOT) + os.sep):
                parser.error(f"{p} is inside the jetrl-trainer checkout; put it elsewhere")
        subprocess.run([sys.executable, str(HERE / "build_standins.py"), "--cache", str(cache)], check=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
        if not have_timeout_plugin():
            print("note: pytest-timeout is not installed (pip install pytest-timeout); running without --timeout")
        all_ids = collect_ids(tests, cache, out, args.vocab) if args.resume else None
        if args.resume:
            args.resume = args.resume.resolve()
        opts = dict(score_valid_only=args.score_valid_only, resume=args.resume, rerun=tuple(args.rerun),
                    all_ids=all_ids)
        jet = None
        if args.jet_rev != "worktree" and any(n != "trl" for n in names):
            jet = snapshot_jet(args.jet_rev, out)
            print(f"Jet runs test {jet[1]['commit']} (installed in {jet[0]})")
        if args.parallel:  # one process per run at once; on a shared machine, with --threads 1
            for finish in [start_run(n, tests, out, cache, args.timeout, args.threads, args.pytest_args, args.vocab, jet, **opts)
                           for n in names]:
                finish()
        else:
            for name in names:
                start_run(name, tests, out, cache, args.timeout, args.threads, args.pytest_args, args.vocab, jet, **opts)()
    all_names = [n for n in RUNS if (out / f"{n}.json").exists()]
    print(report(out, all_names))


if __name__ == "__main__":
    main()
