/*
 * bucketd entry point: parses the command line, loads the configuration and hands over to
 * bd_daemon_run(). No daemon logic lives here.
 */
#include <mongoc/mongoc.h>
#include <stdio.h>
#include <string.h>

#include "bucketd/config.h"
#include "bucketd/daemon.h"
#include "bucketd/log.h"

static void usage(FILE *out) {
    fprintf(out,
            "usage: bucketd -c FILE [--check-config]\n"
            "       bucketd --version | --help\n"
            "\n"
            "Time-series ingestion daemon: InfluxDB line protocol and Graphite plaintext over\n"
            "UDP and TCP, stored in MongoDB as one document per sensor per time bucket.\n"
            "\n"
            "  -c, --config FILE   configuration file (YAML; see config/bucketd.yaml)\n"
            "      --check-config  validate FILE, and whether this host can bind the\n"
            "                      addresses it names; exit 0 (valid) or 1 (invalid)\n"
            "      --version       print the version and exit\n"
            "  -h, --help          print this help and exit\n");
}

static void print_warning(void *arg, const char *msg) {
    fprintf(stderr, "bucketd: warning: %s\n", msg);
}

static void print_error(void *arg, const char *msg) {
    fprintf(stderr, "bucketd: %s\n", msg);
}

static void log_warning(void *arg, const char *msg) {
    bd_warn("%s", msg);
}

int main(int argc, char **argv) {
    const char *path = NULL;
    int check_only = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-c") == 0 || strcmp(a, "--config") == 0) {
            if (i + 1 >= argc) {
                fprintf(stderr, "bucketd: %s needs a file name\n", a);
                return 2;
            }
            path = argv[++i];
        } else if (strncmp(a, "--config=", 9) == 0) {
            path = a + 9;
        } else if (strcmp(a, "--check-config") == 0) {
            check_only = 1;
        } else if (strcmp(a, "--version") == 0) {
            printf("bucketd %s\n", BD_VERSION);
            return 0;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "bucketd: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (path == NULL) {
        fprintf(stderr, "bucketd: no configuration file given (-c FILE)\n");
        usage(stderr);
        return 2;
    }

    static struct bd_config cfg;
    /* Validating mongodb.uri goes through libmongoc, whose own log line would repeat our error
     * in another format; the daemon routes the driver's log into ours once it runs. */
    mongoc_log_set_handler(NULL, NULL);
    struct bd_err err = {0};
    if (bd_config_load(&cfg, path, &err) < 0) {
        fprintf(stderr, "bucketd: %s\n", err.msg);
        return 1;
    }
    if (check_only) {
        bd_config_warnings(&cfg, print_warning, NULL);
        if (bd_config_check_binds(&cfg, print_error, NULL) > 0) {
            return 1;
        }
        printf("%s: configuration is valid\n", path);
        return 0;
    }
    bd_log_set_level((enum bd_log_level)cfg.log.level);
    bd_config_warnings(&cfg, log_warning, NULL);
    return bd_daemon_run(&cfg);
}
