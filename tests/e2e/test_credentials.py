#!/usr/bin/python3
"""End-to-end tests of where the MongoDB password lives and of URI hygiene.

- `bucketd --check-config`: an unknown URI option (a typo such as tsl=true) fails naming it;
  options the driver knows under other cases or old names pass; tlsInsecure,
  tlsAllowInvalidCertificates, tlsAllowInvalidHostnames and credentials without TLS to a host
  that is not loopback (PLAIN and SCRAM alike) pass with a warning; mongodb.uri with
  mongodb.uri_file, and mongodb.password_file with a URI that holds a password, fail. No output
  ever holds the password.
- The daemon reads mongodb.uri_file from $CREDENTIALS_DIRECTORY (systemd's LoadCredential=),
  stores what it is sent, and a reload after the file changed reports that it needs a restart.
  When the test server's URI holds a password (a real MongoDB with authentication), the same
  runs with the password in mongodb.password_file.
- The daemon warns at start, naming the file and its mode, when the file holding the password is
  readable by every user, and not when only its owner can read it.
- bucketd-inspect takes the URI from --uri-file, from BUCKETD_MONGODB_URI and from a config
  whose uri_file it resolves as the daemon does.

Run: /usr/bin/python3 tests/e2e/test_credentials.py   (environment: see bdtest.py, plus
BUCKETD_INSPECT_BIN, default <repo>/build/bucketd-inspect)
"""

import os
import re
import socket
import subprocess
import sys
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bdtest  # noqa: E402

INSPECT = (os.environ.get("BUCKETD_INSPECT_BIN") or
           os.path.join(bdtest.REPO, "build", "bucketd-inspect"))
DEADLINE = 120.0
SECRET = "Zq7-sekrit-%d" % os.getpid()


def check_config(path, env=None):
    """bucketd -c path --check-config: (exit status, stdout + stderr)."""
    p = subprocess.run([bdtest.BIN, "-c", path, "--check-config"], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=60,
                       env=dict(os.environ, **env) if env else None)
    return p.returncode, (p.stdout + p.stderr).decode("utf-8", "replace")


def inspect(*args, env=None):
    p = subprocess.run([INSPECT] + [str(a) for a in args], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=120,
                       env=dict(os.environ, **env) if env else None)
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


def write(path, text, mode=0o600):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


class CheckConfig(bdtest.E2ECase):
    """--check-config alone: no server is needed."""

    def config(self, mongodb, mode=0o600):
        cfg = {"listeners": [{"proto": "udp", "bind": "127.0.0.1:%d" % bdtest.free_port("udp")}],
               "spool": {"dir": os.path.join(self.workdir, "spool")},
               "mongodb": mongodb}
        return write(os.path.join(self.workdir, "bucketd.yaml"), bdtest.to_yaml(cfg) + "\n",
                     mode)

    def check(self, mongodb, want_rc, mode=0o600, env=None):
        path = self.config(mongodb, mode)
        rc, out = check_config(path, env)
        self.assertEqual(rc, want_rc, out)
        self.assertNotIn(SECRET, out)
        return out

    def warnings(self, out):
        return [l for l in out.splitlines() if "warning:" in l]

    def test_unknown_option_fails_naming_it_known_ones_pass(self):
        out = self.check({"uri": "mongodb://db1.example:27017/?tsl=true"}, 1)
        self.assertRegex(out, r"bucketd\.yaml:\d+:\d+: mongodb\.uri: unknown URI option \"tsl\"")
        self.assertIn('did you mean "tls"', out)
        out = self.check({"uri": "mongodb://db1.example/?replicaSet=rs0&conectTimeoutMS=100"}, 1)
        self.assertIn('"conectTimeoutMS"', out)
        # Names the driver knows pass in any case and under their old (ssl*) names.
        out = self.check({"uri": "mongodb://127.0.0.1/?REPLICASET=rs0&ssl=false&wtimeoutms=100"
                                 "&readPreference=nearest&readPreferenceTags=dc:ny&readPreferenceTags=&appname=x"
                                 "&w=majority&retryWrites=true&compressors=zlib"}, 0)
        self.assertEqual(self.warnings(out), [], out)

    def test_weakened_tls_passes_with_a_warning(self):
        for opt in ("tlsInsecure", "tlsAllowInvalidCertificates", "tlsAllowInvalidHostnames",
                    "sslAllowInvalidCertificates"):
            with self.subTest(opt=opt):
                out = self.check({"uri": "mongodb://db1.example/?tls=true&%s=true" % opt}, 0)
                canon = opt.replace("ssl", "tls")
                w = self.warnings(out)
                self.assertEqual(len(w), 1, out)
                self.assertIn("mongodb.uri: %s=true" % canon, w[0])

    def test_credentials_without_tls_to_a_remote_host_warn(self):
        for uri, mech in (("mongodb://u:%s@db1.example/?authMechanism=PLAIN&authSource=$external"
                           % SECRET, "PLAIN"),
                          ("mongodb://u:%s@db1.example/" % SECRET, "SCRAM"),
                          ("mongodb://u:%s@db1.example/?authMechanism=SCRAM-SHA-256" % SECRET,
                           "SCRAM-SHA-256")):
            with self.subTest(mech=mech):
                out = self.check({"uri": uri}, 0)
                w = [l for l in self.warnings(out) if "without TLS" in l]
                self.assertEqual(len(w), 1, out)
                self.assertIn("db1.example", w[0])
                self.assertIn(mech, w[0])
        # With TLS, or to loopback, no such warning.
        for uri in ("mongodb://u:%s@db1.example/?tls=true" % SECRET,
                    "mongodb://u:%s@127.0.0.1/?authMechanism=PLAIN" % SECRET,
                    "mongodb://u:%s@localhost:27017/" % SECRET):
            with self.subTest(uri=uri.replace(SECRET, "*")):
                out = self.check({"uri": uri}, 0)
                self.assertEqual(self.warnings(out), [], out)

    def test_one_place_for_the_uri_and_the_password(self):
        uri_file = write(os.path.join(self.workdir, "mongodb-uri"), "mongodb://127.0.0.1/\n")
        pw_file = write(os.path.join(self.workdir, "pw"), SECRET + "\n")
        out = self.check({"uri": "mongodb://127.0.0.1/", "uri_file": uri_file}, 1)
        self.assertRegex(out, r"mongodb\.uri_file: give mongodb\.uri or mongodb\.uri_file")
        out = self.check({"uri": "mongodb://u:other@127.0.0.1/", "password_file": pw_file}, 1)
        self.assertRegex(out, r"mongodb\.password_file: mongodb\.uri already holds a password")
        out = self.check({"uri": "mongodb://127.0.0.1/", "password_file": pw_file}, 1)
        self.assertIn("names no user", out)
        out = self.check({"uri_file": os.path.join(self.workdir, "missing")}, 1)
        self.assertRegex(out, r"mongodb\.uri_file: .*missing: No such file")
        write(uri_file, "mongodb://u:%s@127.0.0.1/?tsl=true\n" % SECRET)
        out = self.check({"uri_file": "mongodb-uri"}, 1)  # relative: beside the config
        self.assertIn('mongodb.uri_file: %s: unknown URI option "tsl"' % uri_file, out)
        out = self.check({"uri": "mongodb://u@127.0.0.1/", "password_file": "pw"}, 0)
        self.assertEqual(self.warnings(out), [], out)

    def test_relative_names_resolve_in_the_credentials_directory(self):
        creds = os.path.join(self.workdir, "creds")
        os.mkdir(creds)
        write(os.path.join(creds, "mongodb-uri"), "  mongodb://127.0.0.1/?tsl=1\n")
        out = self.check({"uri_file": "mongodb-uri"}, 1, env={"CREDENTIALS_DIRECTORY": creds})
        self.assertIn(os.path.join(creds, "mongodb-uri"), out)
        write(os.path.join(creds, "mongodb-uri"), "mongodb://127.0.0.1/\n")
        self.check({"uri_file": "mongodb-uri"}, 0, env={"CREDENTIALS_DIRECTORY": creds})

    def test_world_readable_password_is_named_with_its_mode(self):
        out = self.check({"uri": "mongodb://u:%s@127.0.0.1/" % SECRET}, 0, mode=0o644)
        w = self.warnings(out)
        self.assertEqual(len(w), 1, out)
        self.assertIn("bucketd.yaml", w[0])
        self.assertIn("0644", w[0])
        pw = write(os.path.join(self.workdir, "pw"), SECRET, 0o604)
        out = self.check({"uri": "mongodb://u@127.0.0.1/", "password_file": pw}, 0, mode=0o644)
        w = self.warnings(out)
        self.assertEqual(len(w), 1, out)
        self.assertIn(pw, w[0])
        self.assertIn("0604", w[0])
        os.chmod(pw, 0o600)
        out = self.check({"uri": "mongodb://u@127.0.0.1/", "password_file": pw}, 0, mode=0o644)
        self.assertEqual(self.warnings(out), [], out)


class Credentials(bdtest.E2ECase):

    def test_uri_file_from_the_credentials_directory(self):
        uri, client, db = self.new_database()
        creds = os.path.join(self.workdir, "creds")
        os.makedirs(creds)
        parsed = urllib.parse.urlsplit(uri)
        extra = {}
        if parsed.password is not None:
            # A server with authentication: the password goes to its own file, the rest of the
            # URI stays in the config.
            netloc = parsed.netloc.replace(":" + parsed.password + "@", "@", 1)
            bare = urllib.parse.urlunsplit(parsed._replace(netloc=netloc))
            write(os.path.join(creds, "mongodb-password"),
                  urllib.parse.unquote(parsed.password) + "\n")
            extra = {"uri": bare, "password_file": "mongodb-password"}
            key = "mongodb.password_file"
        else:
            write(os.path.join(creds, "mongodb-uri"), uri + "\n")
            extra = {"uri_file": "mongodb-uri"}
            key = "mongodb.uri_file"
        d = self.daemon(uri, db, env={"CREDENTIALS_DIRECTORY": creds},
                        extra={"mongodb": extra})
        if "uri_file" in extra:
            del d.config["mongodb"]["uri"]
        d.start()
        n = 20
        now_ns = time.time_ns()
        lines = ["cred,s=a v=%d %d" % (i, now_ns + i) for i in range(n)]
        with socket.create_connection(d.addr("tcp")) as sock:
            sock.sendall(("\n".join(lines) + "\n").encode())
        got = bdtest.wait_stored(client, db, n, DEADLINE)
        self.assertEqual(got, n, d.log())

        # The file changes: the running connection is kept, and the reload says so.
        if key == "mongodb.uri_file":
            write(os.path.join(creds, "mongodb-uri"),
                  bdtest.with_uri_options(uri, appName="changed") + "\n")
        else:
            write(os.path.join(creds, "mongodb-password"), "another-password\n")
        out = d.reload()
        self.assertRegex(out, r"reload: %s \(its content\): .*needs a restart" % re.escape(key),
                         out)
        st = d.stop()
        self.assertStat(st, "readings_flushed", n, d)
        if parsed.password:
            self.assertNotIn(urllib.parse.unquote(parsed.password), d.log())

        # bucketd-inspect: the same config (uri_file resolved as the daemon does), --uri-file
        # and the environment.
        if not os.access(INSPECT, os.X_OK):
            self.fail("bucketd-inspect not found at %s (set BUCKETD_INSPECT_BIN)" % INSPECT)
        uri_file = write(os.path.join(self.workdir, "inspect-uri"), uri + "\n")
        want = "verified 1 documents, %d readings" % n
        for how, args, env in (
                ("config", ["-c", d.config_path], {"CREDENTIALS_DIRECTORY": creds}),
                ("--uri-file", ["--uri-file", uri_file, "--database", db], None),
                ("environment", ["--database", db], {"BUCKETD_MONGODB_URI": uri})):
            with self.subTest(how=how):
                if how == "config" and key == "mongodb.uri_file":
                    write(os.path.join(creds, "mongodb-uri"), uri + "\n")
                if how == "config" and key == "mongodb.password_file":
                    continue  # the file now holds another password
                rc, out, err = inspect(*args, "verify", env=env)
                self.assertEqual(rc, 0, out + err)
                self.assertIn(want, out)

    def test_start_warns_about_a_world_readable_password_file(self):
        """The password file's mode is checked at start: 0644 is named in a warning (the file
        and its mode), 0600 is not. The password never reaches the log."""
        uri, client, db = self.new_database()
        parsed = urllib.parse.urlsplit(uri)
        host = parsed.hostname if ":" not in (parsed.hostname or "") else "[%s]" % parsed.hostname
        bare = "mongodb://bucketd@%s:%d/" % (host, parsed.port or 27017)
        for mode, warned in ((0o644, True), (0o600, False)):
            with self.subTest(mode=oct(mode)):
                pw = write(os.path.join(self.workdir, "pw-%o" % mode), SECRET + "\n", mode)
                d = self.daemon(uri, db, name="d%o" % mode,
                                extra={"mongodb": {"uri": bare, "password_file": pw}})
                d.start()
                d.stop(expect_rc=None)
                lines = [l for l in d.log_lines() if pw in l and "password" in l]
                if warned:
                    self.assertEqual(len(lines), 1, d.log())
                    self.assertIn("0644", lines[0])
                    self.assertTrue(lines[0].startswith("<4>"), lines[0])
                else:
                    self.assertEqual(lines, [], d.log())
                self.assertNotIn(SECRET, d.log())


if __name__ == "__main__":
    unittest.main()
