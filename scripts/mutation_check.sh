#!/usr/bin/env bash
# Mutation testing of the formula modules with mutmut 3 (docs/MUTATION_REPORT.md).
#
#   pip install -e ".[test,mutation]"
#   scripts/mutation_check.sh                      # every formula module, a seeded 5 % sample of each
#                                                  # (the default; timed in docs/MUTATION_REPORT.md)
#   scripts/mutation_check.sh model.energy model.mobility   # some modules (dotted paths under transformer_pde/)
#   TESTS="tests/test_energy_and_field_formulas.py tests/test_field.py" scripts/mutation_check.sh model.mobility   # narrower tests
#   SAMPLE=0.3 SEED=0 scripts/mutation_check.sh model.softmax  # a seeded random 30 % of the module's mutants
#   SAMPLE=0.25 FULL="model.energy" scripts/mutation_check.sh model.energy model.field  # all of energy
#   REF=HEAD scripts/mutation_check.sh model.energy               # the committed tree, not the working copy
#   FUNCS="head_columns _fused_diagnostics" SAMPLE=1 scripts/mutation_check.sh model.moments model.field
#                                                  # only the mutants of these functions (a change's new code)
#   REUSE=$HOME/old_workdir scripts/mutation_check.sh       # keep an earlier run's kills of unchanged functions
#                                                  # (REUSE_SURVIVORS=1: and its survivors; run only the unchecked)
#   python scripts/mutation_summary.py "$WORKDIR"            # the score table and every survivor
#
# Works on a scratch copy of the tree (WORKDIR, default a fresh mktemp dir) so the checkout is
# never touched; mutmut's configuration is [tool.mutmut] in pyproject.toml.  mutmut first runs
# the selected tests once and records which tests reach each function; every mutant then runs
# only those tests (coverage-based selection), on MAX_CHILDREN processes (default 2), in one run
# time-boxed by TIMEOUT seconds (default 3300, so that the whole command stays under an hour).  With SAMPLE=f only a seeded random
# fraction f of each module's mutants runs (the list is kept in $WORKDIR/sample_<module>.txt; mutants
# already checked are not rerun, so a stopped run continues).  Not part of the default CI run.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
MAX_CHILDREN=${MAX_CHILDREN:-2}
TIMEOUT=${TIMEOUT:-3300}
WORKDIR=${WORKDIR:-$(mktemp -d -t transformer_pde_mutation.XXXXXX)}
if [ "$#" -eq 0 ]; then
  set -- model.mobility model.energy model.field model.backends model.moments model.softmax model.plans model.values model.normalization model.transport processes.weights analysis.theory.__init__ analysis.theory.particles solvers.parts solvers.particle.evaluator solvers.particle.fixed_step solvers.particle.adaptive solvers.particle.methods solvers.trajectory solvers.jko.front solvers.jko.theta solvers.jko.problem solvers.jko.run solvers.jko.methods solvers.jko.lagrangian solvers.jko.eulerian solvers.jko.lbfgs
fi
python -c "import mutmut" 2>/dev/null || { echo "mutmut is not installed: pip install -e '.[mutation]'" >&2; exit 2; }

echo "scratch copy: $WORKDIR"
mkdir -p "$WORKDIR"
# the sources, tests, shipped configs and configuration only (no runs/, results/, caches)
# (REF=<commit>: those files as committed there, so the run is reproducible and edits in progress
# in the checkout cannot leak into it)
if [ -n "${REF:-}" ]; then
  git -C "$REPO" archive "$REF" pyproject.toml transformer_pde tests experiments | tar -C "$WORKDIR" -xf -
else
  tar -C "$REPO" -cf - pyproject.toml transformer_pde tests experiments | tar -C "$WORKDIR" -xf -
fi
cd "$WORKDIR"
# mutate only the modules asked for (mutmut generates every configured module before it runs
# any), and optionally a narrower test selection, e.g. TESTS="tests/test_energy_and_field_formulas.py"
python - "${TESTS:-}" "$@" <<'PY'
import re, sys
tests, mods = sys.argv[1], sys.argv[2:]
s = open("pyproject.toml").read()
files = ", ".join(f'"transformer_pde/{m.replace(".", "/")}.py"' for m in mods)
s = re.sub(r"only_mutate = \[[^\]]*\]", f"only_mutate = [{files}]", s)
if tests:
    sel = ", ".join(f'"{t}"' for t in tests.split())
    s = re.sub(r"pytest_add_cli_args_test_selection = \[[^\]]*\]", f"pytest_add_cli_args_test_selection = [{sel}]", s)
open("pyproject.toml", "w").write(s)
PY
export OMP_NUM_THREADS=1 PYTHONPATH="$WORKDIR${PYTHONPATH:+:$PYTHONPATH}"

# generate the mutants (and the test map) once; the no-match filter then stops mutmut
python -m mutmut run --max-children 1 "transformer_pde.__generate_only__.*" > "mutmut_gen.log" 2>&1 || true
todo=()
for mod in "$@"; do
  meta="mutants/transformer_pde/${mod//.//}.py.meta"
  [ -f "$meta" ] || { echo "mutant generation failed for $mod: see $WORKDIR/mutmut_gen.log" >&2; exit 1; }
  frac=${SAMPLE:-0.05}
  case " ${FULL:-} " in *" $mod "*) frac=1 ;; esac
  # mutant names are <module path>.<function>__mutmut_<k>; the sample is seeded, so a rerun picks the same
  mapfile -t sel < <(python - "$meta" "$frac" "${SEED:-0}" "sample_$mod.txt" "${REUSE:-}" "${REUSE_SURVIVORS:-0}" "${FUNCS:-}" <<'PY'
import json, os, random, sys
meta, frac, seed, out, reuse, keep_survivors = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6] == "1"
funcs = set(sys.argv[7].split())
data = json.load(open(meta))
codes = data["exit_code_by_key"]


def function_of(name):  # <module>.x_<function>__mutmut_<k> (methods: xǁ<Class>ǁ<method>__mutmut_<k>)
    fn = name.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]
    return fn.split("ǁ")[-1] if "ǁ" in fn else fn[2:] if fn.startswith("x_") else fn


names = sorted(n for n in codes if not funcs or function_of(n) in funcs)
pick = names if frac >= 1 else sorted(random.Random(seed).sample(names, round(frac * len(names))))
open(out, "w").write("\n".join(pick) + "\n")
old = os.path.join(reuse, meta) if reuse else ""
if old and os.path.exists(old):
    # REUSE=<earlier WORKDIR>: take over its results for mutants of functions whose code is unchanged
    # (same mutmut function hash); the tests only grew since, so a kill stands.  Survivors and
    # mutants of changed functions run again (REUSE_SURVIVORS=1: survivors are taken over too, so
    # only the mutants the earlier run never checked run).
    prev = json.load(open(old))
    same = {f for f, h in data["hash_by_function_name"].items() if prev["hash_by_function_name"].get(f) == h}
    taken = 0
    for n in pick:
        fn = n.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]
        c = prev["exit_code_by_key"].get(n)
        if codes[n] is None and fn in same and c is not None and (c != 0 or keep_survivors):
            codes[n] = c
            taken += 1
    json.dump(data, open(meta, "w"))
    print(f"reused {taken} earlier results from {old}", file=sys.stderr)
for n in pick:
    if codes[n] is None:   # only those not yet checked
        print(n)
PY
)
  echo "transformer_pde.$mod: $(wc -l < "sample_$mod.txt") mutants (fraction $frac), ${#sel[@]} still to run"
  todo+=("${sel[@]}")
done
if [ "${#todo[@]}" -gt 0 ]; then
  # one mutmut run for all of them: every run re-collects coverage and re-checks the clean tests (~3 min)
  echo "running ${#todo[@]} mutants on $MAX_CHILDREN workers (time box ${TIMEOUT}s)"
  start=$(date +%s)
  timeout "$TIMEOUT" python -m mutmut run --max-children "$MAX_CHILDREN" "${todo[@]}" > mutmut_run.log 2>&1 \
    || echo "  (stopped: exit $? — see $WORKDIR/mutmut_run.log; rerun with the same WORKDIR to continue)"
  echo "  $(( $(date +%s) - start )) s"
fi
echo "=== results"
python "$REPO/scripts/mutation_summary.py" "$WORKDIR"
echo "inspect a mutant: (cd $WORKDIR && python -m mutmut show <name>)"
