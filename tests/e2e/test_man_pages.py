"""The man pages (tools/man/*.scd) against the programs, the code and README.md: they must not
drift apart.

- every option a program's --help shows is documented in its man page (a definition line,
  "*--option* ..."), and every option the man page documents is in --help;
- bucketd-inspect's commands (its usage lines) each have a section in bucketd-inspect(1);
- every key of the configuration schema (src/config_schema.c) is defined in bucketd.yaml(5),
  source and built page;
- every counter and gauge of include/bucketd/stats.h, and every metric family and drop reason a
  real daemon's /metrics serves, is in bucketd-metrics(7);
- every man page README.md names is one the build makes, and README.md stays under 420 lines.

Environment: BUCKETD_BIN, BUCKETD_PARSE_BIN, BUCKETD_SIM_BIN, BUCKETD_INSPECT_BIN (the build's
programs, set by ctest), BUCKETD_SOURCE_DIR (the repository).
"""

import importlib.util
import os
import re
import subprocess
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("BUCKETD_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(REPO, "build")
PROGRAMS = {
    # program: (environment variable, man page)
    "bucketd": ("BUCKETD_BIN", "bucketd.8"),
    "bucketd-parse": ("BUCKETD_PARSE_BIN", "bucketd-parse.1"),
    "bucketd-sim": ("BUCKETD_SIM_BIN", "bucketd-sim.1"),
    "bucketd-inspect": ("BUCKETD_INSPECT_BIN", "bucketd-inspect.1"),
}
# An option: -x or --long-name, not inside a word (e.g. "non-zero", "w-<id>").
OPTION_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])(?![\w-])")

spec = importlib.util.spec_from_file_location("build_man", os.path.join(REPO, "tools", "man",
                                                                          "build-man.py"))
build_man = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_man)


def program(name):
    var, _page = PROGRAMS[name]
    return os.environ.get(var) or os.path.join(BUILD, name)


def help_text(name):
    out = subprocess.run([program(name), "--help"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, timeout=60, check=True)
    return out.stdout.decode()


def man_source(name):
    with open(os.path.join(REPO, "tools", "man", PROGRAMS[name][1] + ".scd"), encoding="utf-8") as f:
        return f.read()


def documented_options(scd):
    """Options on the man page's definition lines: lines starting with *-."""
    found = set()
    for line in scd.splitlines():
        if line.startswith("*-"):
            found.update(OPTION_RE.findall(line))
    return found


class ManPagesMatchHelp(unittest.TestCase):
    def check_program(self, name):
        help_opts = set(OPTION_RE.findall(help_text(name)))
        self.assertIn("--help", help_opts, "%s --help shows no options?" % name)
        man_opts = documented_options(man_source(name))
        self.assertFalse(sorted(help_opts - man_opts),
                         "options of '%s --help' that tools/man/%s.scd does not document"
                         % (name, PROGRAMS[name][1]))
        self.assertFalse(sorted(man_opts - help_opts),
                         "options tools/man/%s.scd documents that '%s --help' does not show"
                         % (PROGRAMS[name][1], name))

    def test_bucketd(self):
        self.check_program("bucketd")

    def test_bucketd_parse(self):
        self.check_program("bucketd-parse")

    def test_bucketd_sim(self):
        self.check_program("bucketd-sim")

    def test_bucketd_inspect(self):
        self.check_program("bucketd-inspect")

    def test_bucketd_inspect_commands(self):
        commands = set()
        for line in help_text("bucketd-inspect").splitlines():
            m = re.match(r"^\s*(?:usage:)?\s*bucketd-inspect \[CONNECTION\] ((?:[a-z][a-z-]* ?)+)",
                         line)
            if m:
                commands.add(m.group(1).strip())
        self.assertGreaterEqual(len(commands), 5, commands)
        scd = man_source("bucketd-inspect")
        for command in sorted(commands):
            self.assertRegex(scd, r"(?m)^## %s$" % re.escape(command),
                             "bucketd-inspect(1) has no section for the command '%s'" % command)


MAN_DIR = os.path.join(REPO, "tools", "man")
CONFIG_PAGE = "bucketd.yaml.5"
METRICS_PAGE = "bucketd-metrics.7"


def page_source(page):
    """A page's scdoc text as scdoc sees it, its escapes taken out (*a\\_b* is a_b)."""
    text = build_man.scd_text(os.path.join(MAN_DIR, page + ".scd"), "0")
    return text.replace("\\", "")


def built_page(page):
    """The page the build made (man/ beside the programs); \\& is roff's zero-width mark."""
    path = os.path.join(os.path.dirname(program("bucketd")), "man", page)
    if not os.path.exists(path):
        raise AssertionError("%s was not built (no scdoc at configure time? "
                             "tools/install-deps.sh installs it)" % path)
    with open(path, encoding="utf-8") as f:
        return f.read().replace("\\&", "")


def built_pages():
    """Every page the build installs (tools/packaging/packaging.cmake, BD_MAN_PAGES)."""
    with open(os.path.join(REPO, "tools", "packaging", "packaging.cmake"), encoding="utf-8") as f:
        m = re.search(r"set\(BD_MAN_PAGES([^)]*)\)", f.read())
    return m.group(1).split()


def config_keys():
    """Every key of the configuration schema (src/config_schema.c: one row per key)."""
    with open(os.path.join(REPO, "src", "config_schema.c"), encoding="utf-8") as f:
        keys = re.findall(r'\.path = "([^"]+)"', f.read())
    return keys


def stats_names():
    """The counters and gauges of the stats line (include/bucketd/stats.h's X-macros)."""
    with open(os.path.join(REPO, "include", "bucketd", "stats.h"), encoding="utf-8") as f:
        text = f.read()
    names = []
    for macro in ("BD_STATS_LIST", "BD_GAUGES_LIST"):
        body = re.search(r"#define %s\(X\)(.*?)(?:\n\n|\n/\*|\n#)" % macro, text, re.S).group(1)
        names += re.findall(r"\bX\((\w+),", body)
    return names


class ManPagesHoldTheReference(unittest.TestCase):
    def test_every_config_key_in_the_config_page(self):
        keys = config_keys()
        self.assertGreater(len(keys), 50, "src/config_schema.c lists only %d keys?" % len(keys))
        self.assertIn("metrics.silent_after", keys)
        scd = page_source(CONFIG_PAGE)
        roff = built_page(CONFIG_PAGE)
        # A key is documented where it is defined: a line of its own, "*key*" (bold) and at
        # most its default in brackets, its meaning indented below; the built page holds it too.
        missing = [k for k in keys
                   if not re.search(r"(?m)^\*%s\*(?: \(.*\))?\n\t\S" % re.escape(k), scd)]
        self.assertEqual(missing, [], "keys of src/config_schema.c that %s.scd does not define"
                         % CONFIG_PAGE)
        self.assertEqual([k for k in keys if k not in roff], [],
                         "keys the built %s lacks (rebuild?)" % CONFIG_PAGE)

    def test_every_counter_and_gauge_in_the_metrics_page(self):
        names = stats_names()
        self.assertGreater(len(names), 60, "include/bucketd/stats.h lists only %d?" % len(names))
        self.assertIn("readings_lost", names)
        self.assertIn("previous_stop_readings_lost", names)
        scd = page_source(METRICS_PAGE)
        missing = [n for n in names if not re.search(r"\b%s\b" % re.escape(n), scd)]
        self.assertEqual(missing, [], "counters and gauges of include/bucketd/stats.h that %s "
                         "does not name" % METRICS_PAGE)

    def test_every_page_readme_links_is_built(self):
        with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        pages = set(built_pages())
        for page in pages:
            self.assertTrue(os.path.exists(os.path.join(MAN_DIR, page + ".scd")), page)
        named = set("%s.%s" % m for m in re.findall(r"\b(bucketd[\w.-]*)\(([1-8])\)", readme))
        self.assertGreaterEqual(len(named), 4, "README.md names %s" % sorted(named))
        self.assertEqual(sorted(named - pages), [], "README.md names man pages not built")
        # Links to the page sources (tools/man/NAME.SECTION.scd) name sources that exist.
        for target in re.findall(r"\]\((tools/man/[^)#]+)", readme):
            self.assertTrue(os.path.exists(os.path.join(REPO, target)), target)
        self.assertIn(CONFIG_PAGE, named)
        self.assertIn(METRICS_PAGE, named)
        self.assertIn("bucketd-schema.7", named)

    def test_readme_stays_short(self):
        with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
            lines = f.read().splitlines()
        self.assertLessEqual(len(lines), 420, "README.md has %d lines: the reference belongs "
                             "in the man pages (tools/man)" % len(lines))


class EveryMetricOfAScrapeInTheMetricsPage(unittest.TestCase):
    """A real daemon (sink mongodb, the test server, a UDP and a TCP listener) scraped: every
    metric family of its /metrics, and every drop reason, is in bucketd-metrics(7)."""

    def test_every_metric_of_a_real_scrape(self):
        import sys
        import tempfile
        import urllib.request
        sys.path.insert(0, HERE)
        import bdtest
        from bdtest import send_readings as sr

        mongo = bdtest.start_mongo()
        self.addCleanup(mongo.stop)
        work = tempfile.mkdtemp(prefix="bucketd-man-")
        port = bdtest.free_port()
        d = bdtest.Daemon(work, mongo.uri, bdtest.unique_db_name("e2e_man"),
                          extra={"metrics": {"bind": "127.0.0.1:%d" % port}})
        self.addCleanup(d.kill)
        d.start()
        readings = sr.make_readings(sensors=3, per_sensor=10, seed=5)
        sr.send(readings, udp=d.addr("udp"), tcp=d.addr("tcp"))

        def scrape():
            text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port,
                                          timeout=10).read().decode()
            m = re.search(r"(?m)^bucketd_readings_flushed_total (\d+)", text)
            return text if m and int(m.group(1)) == len(readings) else None
        text = bdtest.wait_for(scrape, 60, interval=0.1)
        self.assertTrue(text, "the readings were never written\n" + bdtest.log_tail(d.log()))
        families = re.findall(r"(?m)^# TYPE (\w+) (\w+)$", text)
        self.assertGreater(len(families), 60, text[:2000])
        names = {name for name, _ in families}
        self.assertIn("bucketd_spool_max_bytes", names, "no MongoDB sink's metrics")
        reasons = set(re.findall(r'bucketd_dropped_total\{reason="(\w+)"\}', text))
        self.assertIn("parse_error", reasons)
        scd = page_source(METRICS_PAGE)
        roff = built_page(METRICS_PAGE)
        missing = sorted(n for n in names if n not in scd)
        self.assertEqual(missing, [], "metrics of a real scrape that %s does not name"
                         % METRICS_PAGE)
        self.assertEqual(sorted(n for n in names if n not in roff), [],
                         "metrics the built %s lacks (rebuild?)" % METRICS_PAGE)
        self.assertEqual(sorted(r for r in reasons if r not in scd), [],
                         "drop reasons of bucketd_dropped_total that %s does not name"
                         % METRICS_PAGE)


if __name__ == "__main__":
    unittest.main()
