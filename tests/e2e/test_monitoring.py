"""The monitoring files bucketd ships, against promtool and a real daemon: the Prometheus rules
(config/prometheus/bucketd-rules.yml) and the Grafana dashboard
(config/grafana/bucketd-dashboard.json), both installed under /usr/share/bucketd/.

- rules: `promtool check rules` with every lint; `promtool test rules` on tests/prometheus/:
  one file per alert, named after it, in which the alert fires and stays quiet (its other
  series: just under the threshold, healthy); with an alert's `for:` taken out, its file fails
  (so it shows the wait); every recording rule checked in recording-rules.test.yml; every alert
  has a severity, a summary, and a description naming README sections that exist;
- dashboard: valid JSON, every panel and query on the ${datasource} variable, panels that do
  not overlap, every query parses (`promtool check rules` on the queries as recording rules,
  Grafana's variables replaced), every recording rule it reads is in the rules file;
- a real daemon (the test server as MongoDB, both listener kinds, readings sent between
  scrapes): every metric name the rules and the dashboard use is in its scrape (histograms by
  their _bucket, _sum and _count), and so is every label value they match on; loaded into
  promtool as series, the scrapes give every dashboard query and recording rule some data, and
  no alert fires on the healthy daemon (run under the clock shim, tests/e2e/clock_shim.c, which
  reports its wall clock synchronised whether or not the test machine's is). So renaming a metric, or a drop reason, fails here.

A PromQL selector here is found by a small lexer (selectors()), not by Prometheus's parser;
promtool has parsed every expression first, and test_lexer pins what the lexer finds.

Run: /usr/bin/python3 tests/e2e/test_monitoring.py   (see bdtest.py for the environment)
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import yaml  # noqa: E402  (python3-yaml)

import bdtest  # noqa: E402
from bdtest import send_readings as sr  # noqa: E402

REPO = bdtest.REPO
RULES = os.path.join(REPO, "config", "prometheus", "bucketd-rules.yml")
DASHBOARD = os.path.join(REPO, "config", "grafana", "bucketd-dashboard.json")
RULE_TESTS = os.path.join(REPO, "tests", "prometheus")
README = os.path.join(REPO, "README.md")

PROMTOOL_MISSING = ("promtool not installed (Debian package prometheus; "
                    "tools/install-deps.sh installs it)")
# Labels Prometheus adds to every series of a target, and the series it makes itself.
TARGET_LABELS = {"job", "instance"}
PROMETHEUS_SERIES = {"up": {"job": set(), "instance": set()}}
# What the dashboard's variables stand for when its queries are checked: one job, one instance
# (the series loaded from the real scrapes carry these), a fixed range for Grafana's intervals.
JOB = "bucketd"
INSTANCE = "gw-1:9273"
GRAFANA_VARS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h",
                "job": JOB, "instance": INSTANCE}
SEVERITIES = {"critical", "warning"}


def promtool():
    return shutil.which("promtool")


def run_promtool(args, timeout=120):
    p = subprocess.run([promtool()] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=timeout)
    return p.returncode, p.stdout.decode(errors="replace")


def load_rules():
    with open(RULES, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return [r for g in doc["groups"] for r in g["rules"]]


def alerts():
    return [r for r in load_rules() if "alert" in r]


def recording_rules():
    return [r for r in load_rules() if "record" in r]


def load_dashboard():
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


def dashboard_panels(dash):
    """Every panel, those inside collapsed rows included."""
    for p in dash["panels"]:
        yield p
        for inner in p.get("panels", []):
            yield inner


LABEL_VALUES_RE = re.compile(r"^label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$", re.S)


def dashboard_queries(dash):
    """[(where, PromQL expression)] of every panel query and every query variable (the
    expression inside label_values(...))."""
    out = []
    for p in dashboard_panels(dash):
        for t in p.get("targets", []):
            out.append(("panel %r, query %s" % (p["title"], t.get("refId")), t["expr"]))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = LABEL_VALUES_RE.match(q)
        if m is None:
            raise AssertionError("variable %s: not label_values(EXPR, LABEL): %r" % (v["name"], q))
        out.append(("variable %s" % v["name"], m.group(1)))
    return out


def substitute_grafana_vars(expr):
    """The expression with $var, ${var} and [[var]] replaced as GRAFANA_VARS says."""
    def repl(m):
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in GRAFANA_VARS:
            raise AssertionError("unknown Grafana variable %r in %r" % (name, expr))
        return GRAFANA_VARS[name]
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", repl, expr)


def readme_sections():
    with open(README, encoding="utf-8") as f:
        return {line.lstrip("#").strip() for line in f if re.match(r"^#{1,6} ", line)}


README_REF_RE = re.compile(r'README ("[^"]+"(?:(?:,| and) "[^"]+")*)')


def readme_refs(text):
    """The section titles a text names: README "A", README "A" and "B", ..."""
    out = []
    for m in README_REF_RE.finditer(" ".join(text.split())):
        out += re.findall(r'"([^"]+)"', m.group(1))
    return out


# ---------------------------------------------------------------------------------------------
# PromQL selectors
# ---------------------------------------------------------------------------------------------

TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<num>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:[a-zA-Z]+\d*)*)
  | (?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>@,(){}\[\]])
""", re.X)
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
AGGREGATORS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
               "bottomk", "topk", "quantile"}


def tokenize(expr):
    toks, pos = [], 0
    while pos < len(expr):
        m = TOKEN_RE.match(expr, pos)
        if m is None:
            raise AssertionError("cannot read %r at %r" % (expr, expr[pos:pos + 20]))
        pos = m.end()
        if m.lastgroup != "ws":
            toks.append((m.lastgroup, m.group()))
    return toks


def unquote(s):
    return s[1:-1] if s.startswith("`") else ast.literal_eval(s)


def skip_group(toks, i, open_, close):
    """Index past the bracket opened at toks[i]."""
    depth = 0
    while i < len(toks):
        if toks[i][1] == open_:
            depth += 1
        elif toks[i][1] == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise AssertionError("unbalanced %s" % open_)


def parse_matchers(toks, i):
    """[(label, op, value)] of the {...} at toks[i], and the index past it."""
    out = []
    i += 1
    while toks[i][1] != "}":
        label, op, value = toks[i][1], toks[i + 1][1], toks[i + 2]
        if toks[i][0] != "id" or op not in ("=", "!=", "=~", "!~") or value[0] != "str":
            raise AssertionError("not a label matcher: %r" % (toks[i:i + 3],))
        out.append((label, op, unquote(value[1])))
        i += 3
        if toks[i][1] == ",":
            i += 1
    return out, i + 1


def selectors(expr):
    """[(metric name, [(label, op, value)])] of every vector selector in a PromQL expression."""
    toks = tokenize(expr)
    out, i = [], 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if kind == "id":
            low = text.lower()
            if low in GROUPING:
                i = skip_group(toks, i + 1, "(", ")") if nxt == "(" else i + 1
                continue
            if nxt == "(" or low in KEYWORDS or low in AGGREGATORS:
                i += 1  # a function or an aggregation, or a keyword
                continue
            matchers = []
            i += 1
            if nxt == "{":
                matchers, i = parse_matchers(toks, i)
            out.append((text, matchers))
        elif text == "{":
            matchers, i = parse_matchers(toks, i)
            names = [v for label, op, v in matchers if label == "__name__" and op == "="]
            out.append((names[0] if names else None, matchers))
        elif text == "[":
            i = skip_group(toks, i, "[", "]")
        else:
            i += 1
    return out


# ---------------------------------------------------------------------------------------------
# Scrapes
# ---------------------------------------------------------------------------------------------

LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_scrape(text):
    """{(name, labels text inside the braces): value} of an exposition."""
    return {(name, labels[1:-1]): v
            for (name, labels), v in bdtest.parse_exposition(text).items()}


def label_model(samples):
    """{metric name: {label: set of values}} of parsed samples."""
    model = {}
    for name, labels in samples:
        entry = model.setdefault(name, {})
        for label, value in LABEL_RE.findall(labels):
            entry.setdefault(label, set()).add(value.replace('\\"', '"').replace("\\\\", "\\"))
    return model


LITERAL_ALTERNATIVES_RE = re.compile(r"[\w.:+-]+(?:\|[\w.:+-]+)*")


def check_names(exprs, model, records):
    """Problems of [(where, expr)]: metric names neither in the scrape model nor recording
    rules of the rules file nor Prometheus's own, and label values matched on that no such
    series carries. records: {name: [(expr, static labels)]}."""
    known = dict(PROMETHEUS_SERIES)
    known.update(model)

    def labels_of(name, seen=()):
        if name in known:
            return known[name]
        out = {}
        for expr, static in records.get(name, []):
            for inner, _ in selectors(expr):
                if inner is not None and inner not in seen:
                    for label, values in labels_of(inner, seen + (name,)).items():
                        out.setdefault(label, set()).update(values)
            for label, value in static.items():
                out.setdefault(label, set()).add(value)
        return out

    problems = []
    for where, expr in exprs:
        for name, matchers in selectors(expr):
            if name is None:
                problems.append("%s: a selector without a metric name in %r" % (where, expr))
                continue
            if name not in known and name not in records:
                problems.append("%s: %s is not a metric the daemon exports (nor a recording "
                                "rule of %s)" % (where, name, os.path.relpath(RULES, REPO)))
                continue
            labels = labels_of(name)
            for label, op, value in matchers:
                if label in TARGET_LABELS or label == "__name__" or "$" in value:
                    continue
                if label not in labels:
                    problems.append("%s: %s has no label %s" % (where, name, label))
                    continue
                if value == "" or not LITERAL_ALTERNATIVES_RE.fullmatch(value):
                    continue
                wanted = [value] if op in ("=", "!=") else value.split("|")
                missing = sorted(set(wanted) - labels[label])
                if missing:
                    problems.append("%s: %s{%s%s%r}: no series has %s=%s (it has %s)" % (
                        where, name, label, op, value, label, "|".join(missing),
                        ", ".join(sorted(labels[label]))))
    return problems


def records_map():
    out = {}
    for r in recording_rules():
        out.setdefault(r["record"], []).append((r["expr"], r.get("labels", {})))
    return out


def rules_exprs():
    return [("rule %s" % (r.get("alert") or r.get("record")), r["expr"]) for r in load_rules()]


# ---------------------------------------------------------------------------------------------
# The rules file
# ---------------------------------------------------------------------------------------------

class Lexer(unittest.TestCase):
    def test_lexer(self):
        """selectors() finds the metric names and matchers, nothing else."""
        self.assertEqual(selectors(
            'sum by (reason) (rate(bucketd_dropped_total{job=~"$job", reason!~"a|b"}[5m]))'
            ' / ignoring (reason) group_left () instance:x:rate5m offset 1h > bool 0.01'),
            [("bucketd_dropped_total", [("job", "=~", "$job"), ("reason", "!~", "a|b")]),
             ("instance:x:rate5m", [])])
        self.assertEqual(selectors('histogram_quantile(0.99, sum without (instance) '
                                   '(rate(h_bucket[1h30m:1m]))) and on (job) absent(up)'),
                         [("h_bucket", []), ("up", [])])
        self.assertEqual(selectors('{__name__="a_total", x="1"} or count(b) by (le)'),
                         [("a_total", [("__name__", "=", "a_total"), ("x", "=", "1")]),
                          ("b", [])])


class RulesFile(unittest.TestCase):
    def setUp(self):
        if promtool() is None:
            self.skipTest(PROMTOOL_MISSING)

    def test_promtool_check_rules(self):
        rc, out = run_promtool(["check", "rules", "--lint=all", "--lint-fatal", RULES])
        self.assertEqual(rc, 0, out)
        self.assertIn("SUCCESS", out)

    def test_promtool_test_rules(self):
        files = sorted(f for f in os.listdir(RULE_TESTS) if f.endswith(".test.yml"))
        self.assertGreater(len(files), 1)
        rc, out = run_promtool(["test", "rules"] + [os.path.join(RULE_TESTS, f) for f in files])
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("SUCCESS"), len(files), out)

    def test_every_alert_has_a_test_file_that_shows_it_firing_and_quiet(self):
        names = [r["alert"] for r in alerts()]
        self.assertEqual(len(names), len(set(names)), "an alert name twice")
        tested = set()
        for f in sorted(os.listdir(RULE_TESTS)):
            if not f.endswith(".test.yml"):
                continue
            with open(os.path.join(RULE_TESTS, f), encoding="utf-8") as fh:
                doc = yaml.safe_load(fh)
            self.assertEqual(doc["rule_files"], ["../../config/prometheus/bucketd-rules.yml"], f)
            evals = [t for group in doc["tests"] for t in group.get("alert_rule_test", [])]
            for t in evals:
                self.assertIn(t["alertname"], names, "%s tests an alert the file lacks" % f)
            if f == "recording-rules.test.yml":
                continue
            alert = f[:-len(".test.yml")]
            self.assertIn(alert, names, "%s: no alert %s in the rules file" % (f, alert))
            mine = [t for t in evals if t["alertname"] == alert]
            self.assertTrue(any(t["exp_alerts"] for t in mine), "%s: never fires" % f)
            self.assertTrue(any(not t["exp_alerts"] for t in mine), "%s: never quiet" % f)
            firing = min(t["eval_time"] for t in mine if t["exp_alerts"])
            self.assertTrue(any(not t["exp_alerts"] and duration_s(t["eval_time"]) <
                                duration_s(firing) for t in mine),
                            "%s: no quiet evaluation before the first firing one" % f)
            tested.add(alert)
        self.assertEqual(sorted(set(names) - tested), [], "alerts without a test file")

    def test_every_wait_is_tested(self):
        """Each alert's test file fails once its `for:` is taken out: it checks a moment
        when the condition holds and the wait has not passed."""
        with open(RULES, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        waiting = [r["alert"] for g in doc["groups"] for r in g["rules"] if r.get("for")]
        self.assertGreater(len(waiting), 5)
        with tempfile.TemporaryDirectory(prefix="bucketd-rules-") as tmp:
            for alert in waiting:
                mutated = json.loads(json.dumps(doc))
                for g in mutated["groups"]:
                    for r in g["rules"]:
                        if r.get("alert") == alert:
                            del r["for"]
                rules = os.path.join(tmp, "rules.yml")
                with open(rules, "w", encoding="utf-8") as f:
                    json.dump(mutated, f)
                with open(os.path.join(RULE_TESTS, alert + ".test.yml"), encoding="utf-8") as f:
                    test = yaml.safe_load(f)
                test["rule_files"] = [rules]
                path = os.path.join(tmp, alert + ".test.yml")
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(test, f)
                rc, out = run_promtool(["test", "rules", path])
                self.assertNotEqual(rc, 0, "%s.test.yml still passes without its for:\n%s"
                                    % (alert, out))
                self.assertIn("FAILED", out)

    def test_every_recording_rule_is_tested(self):
        with open(os.path.join(RULE_TESTS, "recording-rules.test.yml"), encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        checked = set()
        for group in doc["tests"]:
            for t in group.get("promql_expr_test", []):
                self.assertTrue(t["exp_samples"], t["expr"])
                checked.update(name for name, _ in selectors(t["expr"]))
        self.assertEqual(sorted({r["record"] for r in recording_rules()} - checked), [],
                         "recording rules recording-rules.test.yml does not check")

    def test_every_alert_says_what_to_do(self):
        sections = readme_sections()
        for r in alerts():
            name = r["alert"]
            self.assertIn(r.get("labels", {}).get("severity"), SEVERITIES, name)
            ann = r.get("annotations", {})
            self.assertTrue(ann.get("summary"), "%s: no summary" % name)
            self.assertTrue(ann.get("description"), "%s: no description" % name)
            refs = readme_refs(ann["description"])
            self.assertTrue(refs, "%s: the description names no README section" % name)
            for ref in refs:
                self.assertIn(ref, sections, "%s names README %r, which has no such section"
                              % (name, ref))
            # Without a wait, only events: a counter's increase, or a counter past 0.
            if not r.get("for"):
                self.assertRegex(r["expr"], r"^increase\(|_total > 0$",
                                 "%s fires at once on a state that may flap: give it a for:"
                                 % name)


def duration_s(text):
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total = 0.0
    for number, unit in re.findall(r"(\d+)(ms|s|m|h|d)", str(text)):
        total += int(number) * units[unit]
    return total


# ---------------------------------------------------------------------------------------------
# The dashboard
# ---------------------------------------------------------------------------------------------

class Dashboard(unittest.TestCase):
    def test_valid_json_on_the_datasource_variable(self):
        dash = load_dashboard()
        self.assertEqual(dash["uid"], "bucketd")
        self.assertTrue(dash["title"])
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        self.assertEqual(variables["datasource"]["type"], "datasource")
        self.assertEqual(variables["datasource"]["query"], "prometheus")
        ds = {"type": "prometheus", "uid": "${datasource}"}
        ids, cells = set(), {}
        panels = list(dashboard_panels(dash))
        self.assertGreater(len(panels), 10)
        for p in panels:
            self.assertNotIn(p["id"], ids, "panel id %d twice" % p["id"])
            ids.add(p["id"])
            g = p["gridPos"]
            self.assertLessEqual(g["x"] + g["w"], 24, p["title"])
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    self.assertNotIn((x, y), cells, "%r overlaps %r" % (
                        p["title"], cells.get((x, y))))
                    cells[(x, y)] = p["title"]
            if p["type"] == "row":
                continue
            self.assertEqual(p["datasource"], ds, p["title"])
            self.assertTrue(p.get("targets"), "%s: no query" % p["title"])
            refs = [t["refId"] for t in p["targets"]]
            self.assertEqual(len(refs), len(set(refs)), p["title"])
            for t in p["targets"]:
                self.assertEqual(t["datasource"], ds, p["title"])
                self.assertTrue(t["expr"].strip(), p["title"])
        for v in variables.values():
            if v["type"] == "query":
                self.assertEqual(v["datasource"], ds, v["name"])
        sections = readme_sections()
        for text in [dash["description"]] + [p.get("description", "") for p in panels]:
            for ref in readme_refs(text):
                self.assertIn(ref, sections, "the dashboard names README %r, which has no such "
                              "section" % ref)

    def test_every_query_parses(self):
        if promtool() is None:
            self.skipTest(PROMTOOL_MISSING)
        queries = dashboard_queries(load_dashboard())
        rules = [{"record": "dashboard:query_%d" % i, "expr": substitute_grafana_vars(e)}
                 for i, (_, e) in enumerate(queries)]
        with tempfile.TemporaryDirectory(prefix="bucketd-dashboard-") as tmp:
            path = os.path.join(tmp, "queries.yml")
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
            rc, out = run_promtool(["check", "rules", path])
        legend = "\n".join("  dashboard:query_%d  %s: %s" % (i, w, e)
                           for i, (w, e) in enumerate(queries))
        self.assertEqual(rc, 0, "%s\n%s" % (out, legend))
        self.assertIn("SUCCESS: %d rules found" % len(rules), out)

    def test_recording_rules_it_reads_are_in_the_rules_file(self):
        records = {r["record"] for r in recording_rules()}
        used = {name for _, e in dashboard_queries(load_dashboard())
                for name, _ in selectors(substitute_grafana_vars(e)) if ":" in name}
        self.assertTrue(used)
        self.assertEqual(sorted(used - records), [])


# ---------------------------------------------------------------------------------------------
# A real daemon
# ---------------------------------------------------------------------------------------------

def promtool_value(v):
    text = ("%.6f" % v).rstrip("0").rstrip(".")
    return text if text not in ("", "-0") else "0"


class RealScrape(bdtest.E2ECase):
    db_prefix = "e2e_monitoring"
    SCRAPES = 6     # loaded into promtool one minute apart
    HOLD = 30       # minutes the last scrape's values are held after that

    def scrapes(self):
        """Texts of SCRAPES scrapes of a daemon (sink mongodb, a UDP and a TCP listener),
        readings sent and written before each."""
        uri, client, db = self.new_database()
        port = bdtest.free_port()
        d = self.daemon(uri, db, extra={"metrics": {"bind": "127.0.0.1:%d" % port}},
                        env=bdtest.clock_shim_env())
        d.start()
        texts, sent = [], 0
        for k in range(self.SCRAPES):
            readings = sr.make_readings(sensors=4, per_sensor=25, seed=70 + k, seq_base=sent,
                                        sensor_base=4 * k)
            sr.send(readings, udp=d.addr("udp"), tcp=d.addr("tcp"))
            sent += len(readings)

            def written():
                text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port,
                                              timeout=10).read().decode()
                flushed = parse_scrape(text).get(("bucketd_readings_flushed_total", ""))
                return text if flushed == sent else None
            text = bdtest.wait_for(written, 60, interval=0.1)
            self.assertTrue(text, "readings_flushed never reached %d\n%s" % (
                sent, bdtest.log_tail(d.log(), 30)))
            texts.append(text)
        d.stop()
        return texts

    def test_every_name_is_in_a_real_scrape(self):
        texts = self.scrapes()
        samples = {}
        for t in texts:
            samples.update(parse_scrape(t))
        model = label_model(samples)
        exprs = rules_exprs() + [(w, substitute_grafana_vars(e))
                                 for w, e in dashboard_queries(load_dashboard())]
        problems = check_names(exprs, model, records_map())
        self.assertEqual(problems, [], "\n".join(problems))
        # The scrape is what the test means it to be: both listener kinds, a MongoDB sink.
        self.assertEqual(model["bucketd_listener_info"]["proto"], {"udp", "tcp"})
        self.assertTrue("bucketd_spool_max_bytes" in model, "no MongoDB sink's metrics")
        # And the check can fail: a renamed metric, a renamed drop reason.
        self.assertTrue(check_names([("x", "rate(bucketd_readings_accepted[5m])")], model,
                                    records_map()))
        self.assertTrue(check_names([("x", 'bucketd_dropped_total{reason=~"parse_error|nope"}')],
                                    model, records_map()))
        # The variables list a label Prometheus gives every series.
        for v in load_dashboard()["templating"]["list"]:
            if v["type"] == "query":
                label = LABEL_VALUES_RE.match(v["query"]["query"]).group(2)
                self.assertIn(label, TARGET_LABELS, v["name"])

    def test_queries_have_data_and_alerts_stay_quiet_on_a_real_scrape(self):
        """The scrapes as promtool series (job and instance as Prometheus adds them, one minute
        apart, the last held HOLD minutes): at the last scrape every dashboard query and
        recording rule returns something (absent() of it stays quiet), and no alert of the
        rules file fires then or HOLD minutes later."""
        if promtool() is None:
            self.skipTest(PROMTOOL_MISSING)
        texts = self.scrapes()
        parsed = [parse_scrape(t) for t in texts]
        keys = []
        for p in parsed:
            keys += [k for k in p if k not in keys]
        target = 'job="%s",instance="%s"' % (JOB, INSTANCE)
        series = [{"series": "up{%s}" % target,
                   "values": "1x%d" % (self.SCRAPES + self.HOLD)}]
        for name, labels in keys:
            values = [promtool_value(p[(name, labels)]) if (name, labels) in p else "_"
                      for p in parsed]
            series.append({"series": "%s{%s%s}" % (name, target, "," + labels if labels else ""),
                           "values": " ".join(values) + " %sx%d" % (values[-1], self.HOLD)})
        checks = [(w, substitute_grafana_vars(e)) for w, e in dashboard_queries(load_dashboard())]
        checks += [("recording rule %s" % r["record"], r["record"]) for r in recording_rules()]
        probes = [{"alert": "NoData%d" % i, "expr": "absent(%s)" % e}
                  for i, (_, e) in enumerate(checks)]
        last = "%dm" % (self.SCRAPES - 1)
        later = "%dm" % (self.SCRAPES - 1 + self.HOLD)
        tests = [{"eval_time": last, "alertname": p["alert"], "exp_alerts": []} for p in probes]
        for r in alerts():
            tests += [{"eval_time": t, "alertname": r["alert"], "exp_alerts": []}
                      for t in (last, later)]
        with tempfile.TemporaryDirectory(prefix="bucketd-scrape-") as tmp:
            probe_file = os.path.join(tmp, "probes.yml")
            with open(probe_file, "w", encoding="utf-8") as f:
                json.dump({"groups": [{"name": "probes", "rules": probes}]}, f)
            test_file = os.path.join(tmp, "scrape.test.yml")
            with open(test_file, "w", encoding="utf-8") as f:
                json.dump({"rule_files": [RULES, probe_file], "evaluation_interval": "1m",
                           "group_eval_order": ["bucketd", "probes"],
                           "tests": [{"interval": "1m", "input_series": series,
                                      "alert_rule_test": tests}]}, f)
            rc, out = run_promtool(["test", "rules", test_file])
        legend = "\n".join("  NoData%d: %s: %s" % (i, w, e) for i, (w, e) in enumerate(checks))
        self.assertEqual(rc, 0, "%s\nNoData<i> fired: that query had no data:\n%s" % (out, legend))


if __name__ == "__main__":
    unittest.main()
