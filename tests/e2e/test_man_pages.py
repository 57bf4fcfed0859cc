"""The man pages (tools/man/*.scd) against the programs and README.md: they must not drift apart.

- every option a program's --help shows is documented in its man page (a definition line,
  "*--option* ..."), and every option the man page documents is in --help;
- bucketd-inspect's commands (its usage lines) each have a section in bucketd-inspect(1);
- every key of README.md's configuration table is in bucketd(8): the page's CONFIGURATION
  section is made from that table (tools/man/build-man.py), and the built page holds every key.

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


class ManPageHasEveryConfigKey(unittest.TestCase):
    def readme(self):
        with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
            return f.read()

    def keys(self):
        keys = []
        for row in build_man.config_table(self.readme())[1:]:
            # "`mongodb.database` / `.collection`": each code span of the key cell.
            keys += re.findall(r"`([^`]+)`", row[0])
        self.assertGreater(len(keys), 30)
        return keys

    def test_every_key_in_the_page_source(self):
        scd = build_man.scd_text(os.path.join(REPO, "tools", "man", "bucketd.8.scd"),
                                 os.path.join(REPO, "README.md"), "0")
        plain = scd.replace("\\", "")
        for key in self.keys():
            self.assertIn("*%s*" % key, plain, "bucketd(8) lacks the config key %s" % key)

    def test_every_key_in_the_built_page(self):
        # The page the build made (man/ beside the programs); \& is roff's zero-width mark.
        page = os.path.join(os.path.dirname(program("bucketd")), "man", "bucketd.8")
        self.assertTrue(os.path.exists(page),
                        "%s was not built (no scdoc at configure time? tools/install-deps.sh "
                        "installs it)" % page)
        with open(page, encoding="utf-8") as f:
            roff = f.read().replace("\\&", "")
        for key in self.keys():
            self.assertIn(key, roff, "%s lacks the config key %s (rebuild?)" % (page, key))


if __name__ == "__main__":
    unittest.main()
