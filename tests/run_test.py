#!/usr/bin/python3
"""Runs one test program for ctest, so that a skipped test is reported as skipped, not passed.

ctest counts a test whose exit status is its SKIP_RETURN_CODE (77 here, tests/CMakeLists.txt) as
"Skipped", not "Passed". The test programs themselves do not say so: a Python unittest run and a
Criterion binary both exit 0 when some of their tests were skipped. This runner runs one of
them, reads what was skipped and exits with

  non-zero, not 77   something failed or errored (a failure always wins over a skip), or no test
                     ran at all;
  77                 nothing failed, but at least one test was skipped (or, unittest, expected
                     to fail);
  0                  every test ran and passed.

Every skip is printed at the end of the run and, when BUCKETD_TEST_SKIP_LOG names a file,
appended to it as one line "STAGE<TAB>ID<TAB>REASON": STAGE from BUCKETD_TEST_STAGE (tools/test.sh
sets it per build, e.g. "plain", "asan", "aarch64"), ID the ctest name, a slash and the test,
e.g. "e2e.test_sim/SimSends.test_ipv6_target" or "unit.test_ingest/ingest::udp_ipv6". Those ids
are what .ci/allowed-skips names.

  run_test.py NAME unittest FILE.py              a Python unittest module (tests/e2e/test_*.py)
  run_test.py NAME criterion PROGRAM [ARGS...]   a Criterion test program (tests/unit/)
  run_test.py --report LOG [ALLOWLIST]           tools/test.sh's end of run: list the skips in
                                                 LOG, check them against ALLOWLIST (default
                                                 .ci/allowed-skips) and, when
                                                 BUCKETD_TEST_REQUIRE_ALL=1, exit 1 for any
                                                 skip it does not allow

.ci/allowed-skips: one skip a line, "ID REASON" (ID may use shell wildcards; blank lines and
lines starting with '#' are ignored). A skip is allowed only when its id matches and its reason
is exactly the one written there: a listed test that starts skipping for another reason is
not allowed.
"""

import fnmatch
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

SKIP_STATUS = 77
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def one_line(text):
    return " ".join(str(text).split()) or "(no reason given)"


def record_skips(name, skips):
    """Print the skips (list of (test, reason)) and append them to BUCKETD_TEST_SKIP_LOG."""
    if not skips:
        return
    stage = os.environ.get("BUCKETD_TEST_STAGE") or "-"
    lines = ["%s\t%s/%s\t%s\n" % (stage, name, test, one_line(reason)) for test, reason in skips]
    sys.stdout.flush()
    sys.stderr.write("\n%s: %d skipped (exit status %d, not a pass):\n" % (
        name, len(skips), SKIP_STATUS))
    for test, reason in skips:
        sys.stderr.write("  SKIPPED %s/%s: %s\n" % (name, test, one_line(reason)))
    log = os.environ.get("BUCKETD_TEST_SKIP_LOG")
    if log:
        with open(log, "a") as f:
            f.write("".join(lines))


# ---------------------------------------------------------------------------------------------
# Python unittest modules
# ---------------------------------------------------------------------------------------------

def short_id(test, module):
    """"Class.test" for a test of module; setUpClass/setUpModule holders keep their own id."""
    tid = test.id()
    if tid.startswith(module + "."):
        return tid[len(module) + 1:]
    return tid


def run_unittest(name, path):
    module = os.path.splitext(os.path.basename(path))[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    spec.loader.exec_module(mod)
    suite = unittest.defaultTestLoader.loadTestsFromModule(mod)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    skips = [(short_id(t, module), reason) for t, reason in result.skipped]
    skips += [(short_id(t, module), "expected to fail (expectedFailure)")
              for t, _ in result.expectedFailures]
    record_skips(name, skips)
    if not result.wasSuccessful():
        return 1
    if result.testsRun == 0 and not skips:
        sys.stderr.write("%s: no test ran\n" % name)
        return 1
    return SKIP_STATUS if skips else 0


# ---------------------------------------------------------------------------------------------
# Criterion programs
# ---------------------------------------------------------------------------------------------

def run_criterion(name, argv):
    fd, report = tempfile.mkstemp(prefix="criterion-", suffix=".json")
    os.close(fd)
    try:
        rc = subprocess.call(list(argv) + ["--json=%s" % report])
        try:
            with open(report) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            data = None
            if rc == 0:
                sys.stderr.write("%s: no readable Criterion report (%s)\n" % (name, e))
                return 1
    finally:
        os.unlink(report)
    skips = []
    for suite in (data or {}).get("test_suites", []):
        for t in suite.get("tests", []):
            if t.get("status") == "SKIPPED":
                skips.append(("%s::%s" % (suite.get("name"), t.get("name")),
                              "; ".join(t.get("messages") or [])))
    record_skips(name, skips)
    if rc != 0:
        return rc if rc != SKIP_STATUS else 1
    counted = sum(data.get(k, 0) for k in ("passed", "failed", "errored", "skipped"))
    if counted == 0:
        sys.stderr.write("%s: no test ran\n" % name)
        return 1
    return SKIP_STATUS if skips else 0


# ---------------------------------------------------------------------------------------------
# The end of a tools/test.sh run
# ---------------------------------------------------------------------------------------------

def read_allowlist(path):
    allowed = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(None, 1)
            if len(parts) != 2:
                raise SystemExit("%s:%d: want \"ID REASON\", got %r" % (path, n, line))
            allowed.append((parts[0], one_line(parts[1])))
    return allowed


def report(log, allowlist):
    """Lists every skip of the run; returns the exit status for tools/test.sh."""
    require_all = os.environ.get("BUCKETD_TEST_REQUIRE_ALL") == "1"
    skips = []
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 3:
                    skips.append(tuple(parts))
                elif line.strip():
                    skips.append(("-", line.strip(), "(unreadable skip log line)"))
    if not skips:
        return 0
    allowed = read_allowlist(allowlist) if os.path.exists(allowlist) else []
    name = os.path.relpath(allowlist, REPO)
    bad = 0
    print("== skipped: %d (a skip is not a pass)" % len(skips))
    for stage, tid, reason in skips:
        ok = any(fnmatch.fnmatchcase(tid, pat) and reason == why for pat, why in allowed)
        bad += not ok
        print("  [%s] %s: %s\n      %s" % (stage, tid, reason, "allowed by %s" % name if ok else
                                           "not allowed by %s: fails a CI run" % name))
    if require_all and bad:
        print("FAILED: BUCKETD_TEST_REQUIRE_ALL=1 and %d of these skips are not allowed by %s" % (
            bad, name))
        return 1
    if require_all:
        print("every skip is allowed by %s" % name)
    return 0


def main(argv):
    if len(argv) >= 2 and argv[0] == "--report":
        allowlist = argv[2] if len(argv) > 2 else os.path.join(REPO, ".ci", "allowed-skips")
        return report(argv[1], allowlist)
    if len(argv) == 3 and argv[1] == "unittest":
        return run_unittest(argv[0], argv[2])
    if len(argv) >= 3 and argv[1] == "criterion":
        return run_criterion(argv[0], argv[2:])
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
