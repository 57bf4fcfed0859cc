#!/usr/bin/python3
"""A first run: bucketd --check-config says whether this host can bind what the file names.

  - an address no interface of this host holds (192.0.2.1, TEST-NET-1, RFC 5737: never
    assigned) in a listener and in metrics.bind: exit 1, one error per address naming the file,
    the line and column where the address is written, the key, and why; the bindable listener
    beside them is not named;
  - addresses whose ports are held right now (as by the running daemon, when an edited file is
    checked before a reload or a restart) pass: only the address is tried (port 0);
  - the shipped config/bucketd.yaml names its placeholder address in each listener, by line.

Needs no MongoDB. Run: /usr/bin/python3 tests/e2e/test_first_run.py
"""

import os
import re
import shutil
import socket
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

FOREIGN = "192.0.2.1"


def bindable(host, kind=socket.SOCK_STREAM):
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind((host, 0))
            return True
        except OSError:
            return False


def position(text, needle):
    """(line, column), 1-based, of the first occurrence of needle in text."""
    i = text.index(needle)
    return text.count("\n", 0, i) + 1, i - (text.rfind("\n", 0, i) + 1) + 1


class CheckConfigBinds(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="bucketd-first-run-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def write(self, listeners, metrics_bind):
        cfg = {
            "writer_id": "first-run",
            "listeners": [{"proto": p, "bind": b} for p, b in listeners],
            "mongodb": {"uri": "mongodb://127.0.0.1:1/"},
            "spool": {"dir": os.path.join(self.dir, "spool")},
            "metrics": {"bind": metrics_bind},
        }
        text = bdtest.to_yaml(cfg) + "\n"
        path = os.path.join(self.dir, "bucketd.yaml")
        with open(path, "w") as f:
            f.write(text)
        return path, text

    def check(self, path):
        return bdtest.run_bucketd(["-c", path, "--check-config"])

    def test_foreign_addresses_are_named_by_key_and_line(self):
        self.assertFalse(bindable(FOREIGN), "%s is assigned here: the test needs it foreign" %
                         FOREIGN)
        good = "127.0.0.1:%d" % bdtest.free_port("udp")
        tcp = "%s:8094" % FOREIGN
        metrics = "%s:9273" % FOREIGN
        path, text = self.write([("udp", good), ("tcp", tcp)], metrics)
        rc, out = self.check(path)
        self.assertEqual(rc, 1, out)
        self.assertNotIn("configuration is valid", out)
        for key, value in (("listeners[1].bind", tcp), ("metrics.bind", metrics)):
            line, col = position(text, '"%s"' % value)
            want = '%s:%d:%d: %s: "%s" cannot be bound on this host: ' % (path, line, col, key,
                                                                          value)
            self.assertIn(want, out)
        self.assertEqual(out.count("no network interface of this host has that address"), 2,
                         out)
        self.assertNotIn("listeners[0]", out)
        self.assertNotIn(good, out)

    def test_ports_held_now_pass(self):
        """The daemon holds its ports while a changed file is checked: that is no error."""
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        http = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        for s in (tcp, udp, http):
            self.addCleanup(s.close)
            s.bind(("127.0.0.1", 0))
        tcp.listen(1)
        http.listen(1)
        path, _ = self.write([("udp", "127.0.0.1:%d" % udp.getsockname()[1]),
                              ("tcp", "127.0.0.1:%d" % tcp.getsockname()[1]),
                              ("udp", "0.0.0.0:%d" % udp.getsockname()[1])],
                             "127.0.0.1:%d" % http.getsockname()[1])
        rc, out = self.check(path)
        self.assertEqual(rc, 0, out)
        self.assertIn("%s: configuration is valid" % path, out)

    def test_shipped_config_names_its_placeholder(self):
        shipped = os.path.join(bdtest.REPO, "config", "bucketd.yaml")
        with open(shipped) as f:
            text = f.read()
        binds = re.findall(r'(?m)^    bind: "([^"]+)"$', text)
        self.assertGreaterEqual(len(binds), 2, "listeners of the shipped config")
        host = binds[0].rsplit(":", 1)[0]
        self.assertFalse(bindable(host), "%s is assigned here: the test needs it foreign" % host)
        rc, out = self.check(shipped)
        self.assertEqual(rc, 1, out)
        for i, b in enumerate(binds):
            line, col = position(text, '    bind: "%s"' % b)
            self.assertIn('%s:%d:%d: listeners[%d].bind: "%s"' % (shipped, line, col + 10, i, b),
                          out)
        self.assertNotIn("metrics.bind", out)


if __name__ == "__main__":
    unittest.main()
