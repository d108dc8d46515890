#!/usr/bin/env bash
# Mutation testing of the formula modules with mutmut 3 (docs/MUTATION_REPORT.md).
#
#   pip install -e ".[test,mutation]"
#   scripts/mutation_check.sh                      # every formula module (~1 h on 2 cores)
#   scripts/mutation_check.sh energy mobility      # some modules (names under transformer_pde/, or solvers.particle)
#   TESTS="tests/test_oracles.py tests/test_field.py" scripts/mutation_check.sh mobility   # narrower tests
#
# Works on a scratch copy of the tree (WORKDIR, default a fresh mktemp dir) so the checkout is
# never touched; mutmut's configuration is [tool.mutmut] in pyproject.toml.  mutmut first runs
# the selected tests once and records which tests reach each function; every mutant then runs
# only those tests (coverage-based selection), on MAX_CHILDREN processes (default 2).  Each
# module is time-boxed by MODULE_TIMEOUT seconds (default 1200).  Not part of the default CI run.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
MAX_CHILDREN=${MAX_CHILDREN:-2}
MODULE_TIMEOUT=${MODULE_TIMEOUT:-1200}
WORKDIR=${WORKDIR:-$(mktemp -d -t transformer_pde_mutation.XXXXXX)}
if [ "$#" -eq 0 ]; then
  set -- mobility energy field attention processes transport theory.__init__ theory.particles solvers.parts solvers.particle solvers.jko
fi
python -c "import mutmut" 2>/dev/null || { echo "mutmut is not installed: pip install -e '.[mutation]'" >&2; exit 2; }

echo "scratch copy: $WORKDIR"
mkdir -p "$WORKDIR"
# the sources, tests, shipped configs and configuration only (no runs/, results/, caches)
tar -C "$REPO" -cf - pyproject.toml transformer_pde tests experiments | tar -C "$WORKDIR" -xf -
cd "$WORKDIR"
# mutate only the modules asked for (mutmut generates every configured module before it runs
# any), and optionally a narrower test selection, e.g. TESTS="tests/test_oracles.py"
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

for mod in "$@"; do
  echo "=== transformer_pde.$mod (time box ${MODULE_TIMEOUT}s)"
  start=$(date +%s)
  # mutant names are <module path>.<function>__mutmut_<k>
  timeout "$MODULE_TIMEOUT" python -m mutmut run --max-children "$MAX_CHILDREN" "transformer_pde.$mod.*" \
    > "mutmut_$mod.log" 2>&1 || echo "  (stopped: exit $? — see $WORKDIR/mutmut_$mod.log; rerun to continue, results are cached)"
  echo "  $(( $(date +%s) - start )) s"
done
echo "=== results (survived / timeout / suspicious / not checked)"
python -m mutmut results --all true 2>/dev/null || python -m mutmut results
echo "inspect a mutant: (cd $WORKDIR && python -m mutmut show <name>)"
