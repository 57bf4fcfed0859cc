#!/usr/bin/python3
"""bucketd-inspect top: the live view of a running daemon, read from its /metrics.

  TopOnTerminal  top on a real terminal (a tmux pane: new-session -d, send-keys, capture-pane):
                 the ingest rate is above zero and moves while bucketd-sim sends; 'q' quits;
                 an unreachable endpoint is shown as an error and asked again until a daemon
                 answers there; SIGTERM quits; each time the terminal's modes are restored
                 (stty -a after top equals stty -a before it).
  TopPlain       stdout not a terminal: plain snapshots, the first after two scrapes, without
                 escape sequences, whose totals are what the test sent (readings, and drops by
                 reason); --once; the endpoint from the config file's metrics.bind; the errors
                 for an endpoint that does not answer and for a config without one.

Every wait polls with a deadline (the screen, a file, the metrics); nothing sleeps and then
asserts.

Run: /usr/bin/python3 tests/e2e/test_top.py
Environment (besides bdtest.py's): BUCKETD_INSPECT_BIN, BUCKETD_SIM_BIN (default
<repo>/build/...).
"""

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

SIM = os.environ.get("BUCKETD_SIM_BIN") or os.path.join(bdtest.REPO, "build", "bucketd-sim")
INSPECT = bdtest.INSPECT
# How long a screen or a file may take to show what a test waits for (a loaded machine).
DEADLINE = 30.0

RATE_ROW = re.compile(r"^\s*readings accepted\s+(\S+)\s+(\S+)\s*$", re.M)


def number(text):
    """A figure as top prints it (950, 12.3k, 4.56M, -) as a float; None for "-"."""
    if text == "-":
        return None
    mult = {"k": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], 1)
    return float(text[:-1] if mult != 1 else text) * mult


def row(screen, label):
    """(per second, total) of the row `label` of a screen or snapshot, or None."""
    m = re.search(r"^\s*%s\s+(\S+)\s+(\S+)\s*$" % re.escape(label), screen, re.M)
    return (number(m.group(1)), number(m.group(2))) if m else None


def daemon_with_metrics(case, **kw):
    uri, _client, db = case.new_database("top")
    port = kw.pop("metrics_port", None) or bdtest.free_port()
    d = case.daemon(uri, db, extra={"metrics": {"bind": "127.0.0.1:%d" % port}}, **kw)
    return d, port


def start_sim(case, daemon, rate):
    if not os.access(SIM, os.X_OK):
        raise AssertionError("%s not found (set BUCKETD_SIM_BIN)" % SIM)
    host, port = daemon.addr("udp")
    p = subprocess.Popen([SIM, "--target", "%s:%d" % (host, port), "--proto", "udp",
                          "--sensors", "5", "--rate", str(rate)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)

    def stop():
        if p.poll() is None:
            p.terminate()
            p.wait(10)
    case.addCleanup(stop)
    return p


class Pane:
    """One tmux server of its own (socket in the test's directory) running one command in a
    window of fixed size, wrapped so that its exit status and the terminal modes before and
    after it land in files."""

    def __init__(self, case, args, width=132, height=45):
        if shutil.which("tmux") is None:
            raise AssertionError("tmux is not installed (tools/install-deps.sh installs it)")
        self.dir = case.workdir
        self.sock = os.path.join(self.dir, "tmux.sock")
        script = ('stty -a > "$0.before"; "$@"; echo $? > "$0.rc.tmp"; stty -a > "$0.after"; '
                  'mv "$0.rc.tmp" "$0.rc"')
        base = os.path.join(self.dir, "")
        # The wrapper's $0 is the prefix of the files: <dir>/.rc, <dir>/.before, <dir>/.after.
        self.rc, self.before, self.after = base + ".rc", base + ".before", base + ".after"
        self.tmux("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height),
                  "sh", "-c", script, base, *args)
        case.addCleanup(self.close)

    def tmux(self, *args):
        return subprocess.run(["tmux", "-S", self.sock, "-f", "/dev/null"] + list(args),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=30)

    def screen(self):
        p = self.tmux("capture-pane", "-p", "-t", "top")
        return p.stdout if p.returncode == 0 else ""

    def wait_screen(self, cond, what):
        seen = [""]

        def check():
            seen[0] = self.screen()
            return cond(seen[0])
        if not bdtest.wait_for(check, DEADLINE, 0.1):
            raise AssertionError("the screen did not show %s within %.0fs; last screen:\n%s" %
                                 (what, DEADLINE, seen[0]))
        return seen[0]

    def top_pid(self):
        """The pid of the command the wrapper shell runs."""
        p = self.tmux("display-message", "-p", "-t", "top", "#{pane_pid}")
        sh = int(p.stdout.strip())
        with open("/proc/%d/task/%d/children" % (sh, sh)) as f:
            kids = f.read().split()
        return int(kids[0]) if kids else None

    def wait_exit(self):
        """The command's exit status and the terminal modes (stty -a) before and after it."""
        if not bdtest.wait_for(lambda: os.path.exists(self.rc), DEADLINE, 0.1):
            raise AssertionError("top did not exit within %.0fs; screen:\n%s" %
                                 (DEADLINE, self.screen()))
        with open(self.rc) as f, open(self.before) as b, open(self.after) as a:
            return int(f.read()), b.read(), a.read()

    def close(self):
        self.tmux("kill-server")


class TopOnTerminal(bdtest.E2ECase):
    db_prefix = "top"

    def assertModesRestored(self, before, after):
        self.assertIn(" icanon", " " + before.replace("\n", " "))
        self.assertEqual(before, after, "the terminal's modes after top differ from before it")

    def test_rate_moves_while_the_simulator_sends_and_q_quits(self):
        d, mport = daemon_with_metrics(self)
        d.start()
        start_sim(self, d, 400)
        pane = Pane(self, [INSPECT, "top", "--metrics", "127.0.0.1:%d" % mport,
                           "--interval", "500ms"])

        def moving(first):
            def cond(screen):
                m = RATE_ROW.search(screen)
                if not m or number(m.group(1)) is None or number(m.group(1)) <= 0:
                    return False
                return first is None or (m.group(1) != first[0] and
                                         number(m.group(2)) > number(first[1]))
            return cond
        screen = pane.wait_screen(moving(None), "a readings rate above zero")
        first = RATE_ROW.search(screen).groups()
        self.assertIn("(q quits)", screen)
        self.assertIn("udp  127.0.0.1:%d" % d.addr("udp")[1], screen)
        self.assertRegex(screen, r"MONGODB\s+reachable")
        screen = pane.wait_screen(moving(first), "another rate above zero than %s/s (total %s)"
                                  % first)
        pane.tmux("send-keys", "-t", "top", "q")
        rc, before, after = pane.wait_exit()
        self.assertEqual(rc, 0)
        self.assertModesRestored(before, after)

    def test_unreachable_endpoint_is_shown_and_asked_again_and_sigterm_restores(self):
        mport = bdtest.free_port()
        pane = Pane(self, [INSPECT, "top", "--metrics", "127.0.0.1:%d" % mport,
                           "--interval", "300ms"])
        url = "http://127.0.0.1:%d/metrics" % mport
        screen = pane.wait_screen(lambda s: "cannot reach %s" % url in s, "the error")
        self.assertIn("Connection refused", screen)
        self.assertNotIn("INGEST", screen)
        # A daemon on that address: the next scrapes reach it, the error goes.
        d, _ = daemon_with_metrics(self, metrics_port=mport)
        d.start()
        pane.wait_screen(lambda s: "INGEST" in s and "ERROR" not in s, "the daemon's figures")
        pid = pane.top_pid()
        self.assertIsNotNone(pid)
        os.kill(pid, signal.SIGTERM)
        rc, before, after = pane.wait_exit()
        self.assertEqual(rc, 128 + signal.SIGTERM)
        self.assertModesRestored(before, after)


class TopPlain(bdtest.E2ECase):
    db_prefix = "top"

    def run_top(self, *args, timeout=60):
        p = subprocess.run([INSPECT] + list(args), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr

    def send_and_wait(self, d, mport, good, bad):
        """Sends good readings and bad lines over UDP; waits until the daemon counted all."""
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.addCleanup(s.close)
        for i in range(good):
            s.sendto(b"plain,s=%d v=%di\n" % (i % 3, i), d.addr("udp"))
        for i in range(bad):
            s.sendto(b"not a line protocol line %d\n" % i, d.addr("udp"))
        ok = bdtest.wait_for(
            lambda: bdtest.metric(mport, "bucketd_readings_accepted_total") == good and
            bdtest.metric(mport, "bucketd_lines_total") == good + bad, DEADLINE)
        self.assertTrue(ok, "the daemon did not count %d readings and %d bad lines" %
                        (good, bad))

    def test_snapshots_every_interval_hold_what_was_sent(self):
        d, mport = daemon_with_metrics(self)
        d.start()
        self.send_and_wait(d, mport, 300, 7)
        p = subprocess.Popen([INSPECT, "top", "--metrics", "127.0.0.1:%d" % mport,
                              "--interval", "200ms"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.addCleanup(p.stderr.close)
        self.addCleanup(p.stdout.close)
        self.addCleanup(lambda: p.poll() is None and (p.kill(), p.wait()))
        out = b""
        deadline = time.monotonic() + DEADLINE
        while out.count(b"\nINGEST") < 2 or not out.endswith(b"\n\n"):
            left = deadline - time.monotonic()
            self.assertGreater(left, 0, "no two snapshots within %.0fs: %r" % (DEADLINE, out))
            r, _, _ = select.select([p.stdout], [], [], left)
            if r:
                chunk = os.read(p.stdout.fileno(), 65536)
                if not chunk:
                    self.fail("top exited: %r %r" % (out, p.stderr.read()))
                out += chunk
        p.send_signal(signal.SIGTERM)
        self.assertEqual(p.wait(DEADLINE), 128 + signal.SIGTERM)
        text = out.decode()
        self.assertNotIn("\x1b", text, "escape sequences in plain output")
        self.assertNotIn("(q quits)", text)
        snaps = [s for s in text.split("\n\n") if s.strip()]
        self.assertGreaterEqual(len(snaps), 2)
        for snap in snaps:
            self.assertTrue(snap.startswith("bucketd "), snap)
            self.assertNotIn("rates after the next scrape", snap)
            self.assertEqual(row(snap, "readings accepted"), (0, 300), snap)
            self.assertEqual(row(snap, "lines"), (0, 307), snap)
            self.assertEqual(row(snap, "parse_error"), (0, 7), snap)
            self.assertEqual(row(snap, "udp datagrams"), (0, 307), snap)
            for name in ("udp", "tcp"):
                self.assertIn("%s  127.0.0.1:%d" % (name, d.addr(name)[1]), snap)

    def test_once_from_the_config_file_while_sending(self):
        d, mport = daemon_with_metrics(self)
        d.start()
        self.send_and_wait(d, mport, 50, 0)
        start_sim(self, d, 400)
        rc, out, err = self.run_top("-c", d.config_path, "top", "--once")
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.count("INGEST"), 1, out)
        self.assertIn("http://127.0.0.1:%d/metrics" % mport, out)
        rate, total = row(out, "readings accepted")
        self.assertGreater(rate, 0, out)
        self.assertGreater(total, 50, out)
        self.assertIsNone(row(out, "parse_error"), out)
        self.assertIn("  none\n", out)

    def test_endpoint_that_does_not_answer(self):
        port = bdtest.closed_port()
        url = "http://127.0.0.1:%d/metrics" % port
        for extra in (["--once"], []):
            rc, out, err = self.run_top("top", "--metrics", "127.0.0.1:%d" % port, *extra)
            self.assertEqual(rc, 2, (extra, out, err))
            self.assertEqual(out, "")
            self.assertIn("top: cannot reach %s: Connection refused" % url, err)

    def test_config_without_metrics_and_bad_options(self):
        uri, _client, db = self.new_database("top")
        d = self.daemon(uri, db)  # metrics.bind "" (bdtest's default)
        d.write_config()
        rc, out, err = self.run_top("-c", d.config_path, "top", "--once")
        self.assertEqual(rc, 2)
        self.assertIn("sets metrics.bind to \"\"", err)
        for args, want in ((["--interval", "10ms"], "--interval"),
                           (["--metrics", "127.0.0.1"], "expected HOST:PORT"),
                           (["--metrics", "https://127.0.0.1:9273"], "only http://"),
                           (["--sensor", "x"], "does not apply to 'top'")):
            rc, out, err = self.run_top("top", *args)
            self.assertEqual(rc, 2, args)
            self.assertIn(want, err, args)


if __name__ == "__main__":
    unittest.main()
