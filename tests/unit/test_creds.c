/*
 * Credentials: file lookup and reading, the password inside a URI, the mode check; and what
 * the config makes of them (mongodb.uri_file, mongodb.password_file, the redacted dump, the
 * reload report), and the URI option checks of mongo.c.
 */
#include <criterion/criterion.h>
#include <mongoc/mongoc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/config.h"
#include "bucketd/creds.h"
#include "bucketd/mongo.h"

static char dir[] = "/tmp/bd-creds-XXXXXX";

static void setup(void) {
    cr_assert_not_null(mkdtemp(dir));
    unsetenv("CREDENTIALS_DIRECTORY");
    mongoc_log_set_handler(NULL, NULL);
}

TestSuite(creds, .init = setup);

static const char *put(const char *name, const char *text, mode_t mode) {
    static char path[4][512];
    static int next;
    char *p = path[next++ % 4];
    snprintf(p, 512, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    chmod(p, mode);
    return p;
}

Test(creds, path_lookup) {
    char out[256];
    cr_assert_eq(bd_creds_path("/etc/x", "/a/b.yaml", out, sizeof(out), NULL), 0);
    cr_assert_str_eq(out, "/etc/x");
    cr_assert_eq(bd_creds_path("pw", "/etc/bucketd/bucketd.yaml", out, sizeof(out), NULL), 0);
    cr_assert_str_eq(out, "/etc/bucketd/pw");
    cr_assert_eq(bd_creds_path("pw", "bucketd.yaml", out, sizeof(out), NULL), 0);
    cr_assert_str_eq(out, "pw");
    setenv("CREDENTIALS_DIRECTORY", "/run/credentials/bucketd.service", 1);
    cr_assert_eq(bd_creds_path("pw", "/etc/bucketd/bucketd.yaml", out, sizeof(out), NULL), 0);
    cr_assert_str_eq(out, "/run/credentials/bucketd.service/pw");
    cr_assert_eq(bd_creds_path("/abs", "/etc/bucketd/bucketd.yaml", out, sizeof(out), NULL), 0);
    cr_assert_str_eq(out, "/abs");
    unsetenv("CREDENTIALS_DIRECTORY");
    cr_assert_lt(bd_creds_path("pw", "/etc/bucketd/bucketd.yaml", out, 8, NULL), 0);
}

Test(creds, read_trims_and_refuses) {
    char out[64];
    struct bd_err err = {0};
    cr_assert_eq(bd_creds_read("k", put("a", "  s3cr et\r\n\n", 0600), out, sizeof(out), &err), 0,
                 "%s", err.msg);
    cr_assert_str_eq(out, "s3cr et");
    cr_assert_lt(bd_creds_read("k", put("b", " \n", 0600), out, sizeof(out), &err), 0);
    cr_assert(strstr(err.msg, "empty") != NULL, "%s", err.msg);
    cr_assert_lt(bd_creds_read("k", "/nonexistent/x", out, sizeof(out), &err), 0);
    cr_assert(strstr(err.msg, "k /nonexistent/x: No such file") != NULL, "%s", err.msg);
    cr_assert_lt(bd_creds_read(NULL, "/nonexistent/x", out, sizeof(out), &err), 0);
    cr_assert_str_eq(err.msg, "/nonexistent/x: No such file or directory");
    char big[5000];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    cr_assert_lt(bd_creds_read("k", put("c", big, 0600), out, sizeof(out), &err), 0);
    cr_assert_lt(bd_creds_read("k",
                               put("d",
                                   "0123456789012345678901234567890123456789"
                                   "0123456789012345678901234567890123456789",
                                   0600),
                               out, sizeof(out), &err),
                 0);
}

Test(creds, password_in_the_uri) {
    char out[512];
    struct bd_err err = {0};
    cr_assert(bd_uri_has_user("mongodb://u@h/"));
    cr_assert(!bd_uri_has_user("mongodb://h/?x=a@b"));
    cr_assert(!bd_uri_has_password("mongodb://u@h/"));
    cr_assert(bd_uri_has_password("mongodb://u:p@h/"));
    cr_assert(!bd_uri_has_password("mongodb://h:27017/"));

    const char *pw = "p@ss:w/rd%é ?&";
    cr_assert_eq(
        bd_uri_add_password("mongodb://bucketd@db1:27017/?tls=true", pw, out, sizeof(out), &err), 0,
        "%s", err.msg);
    cr_assert_str_eq(out,
                     "mongodb://bucketd:p%40ss%3Aw%2Frd%25%C3%A9%20%3F%26@db1:27017/?tls=true");
    /* The driver reads back exactly the password. */
    mongoc_uri_t *uri = mongoc_uri_new(out);
    cr_assert_not_null(uri);
    cr_assert_str_eq(mongoc_uri_get_username(uri), "bucketd");
    cr_assert_str_eq(mongoc_uri_get_password(uri), pw);
    mongoc_uri_destroy(uri);

    cr_assert_lt(bd_uri_add_password("mongodb://db1/", "x", out, sizeof(out), &err), 0);
    cr_assert(strstr(err.msg, "names no user") != NULL);
    cr_assert_lt(bd_uri_add_password("mongodb://u:y@db1/", "x", out, sizeof(out), &err), 0);
    cr_assert(strstr(err.msg, "already holds a password") != NULL);

    bd_uri_redact("mongodb://u:secret@h1,h2/?tls=true", out, sizeof(out));
    cr_assert_str_eq(out, "mongodb://u:*****@h1,h2/?tls=true");
    bd_uri_redact("mongodb://u@h/", out, sizeof(out));
    cr_assert_str_eq(out, "mongodb://u@h/");
}

Test(creds, mode_check) {
    char why[160];
    cr_assert(bd_creds_exposed(put("o", "x", 0644), why, sizeof(why)));
    cr_assert(strstr(why, "0644") != NULL, "%s", why);
    cr_assert(!bd_creds_exposed(put("p", "x", 0600), why, sizeof(why)));
    /* Our own group may read it: that is what a root:bucketd 0640 file is for. */
    cr_assert(!bd_creds_exposed(put("g", "x", 0640), why, sizeof(why)));
    cr_assert(!bd_creds_exposed("/nonexistent/x", why, sizeof(why)));
}

Test(creds, unknown_uri_options_refused_known_ones_in_any_spelling_pass) {
    struct bd_err err = {0};
    cr_assert_lt(bd_mongo_uri_check("mongodb://h/?tsl=true", &err), 0);
    cr_assert(strstr(err.msg, "unknown URI option \"tsl\"") != NULL, "%s", err.msg);
    cr_assert(strstr(err.msg, "did you mean \"tls\"") != NULL, "%s", err.msg);
    cr_assert_lt(bd_mongo_uri_check("mongodb://h/?appName=a&bogus=1", &err), 0);
    cr_assert(strstr(err.msg, "\"bogus\"") != NULL, "%s", err.msg);
    cr_assert_eq(bd_mongo_uri_check("mongodb://h/?TLS=false&SSL=false&WTimeoutMS=5&"
                                    "sslAllowInvalidHostnames=false&authSource=admin&"
                                    "maxPoolSize=3&zlibCompressionLevel=1",
                                    &err),
                 0, "%s", err.msg);
    /* A password the driver quotes in its error is not shown. */
    cr_assert_lt(bd_mongo_uri_check("mongodb://u:se:cret@h/", &err), 0);
    cr_assert(strstr(err.msg, "se:cret") == NULL && strstr(err.msg, "*****") != NULL, "%s",
              err.msg);
}

struct warned {
    int n;
    char text[4][512];
};

static void note(void *arg, const char *msg) {
    struct warned *w = arg;
    if (w->n < 4) {
        snprintf(w->text[w->n], sizeof(w->text[0]), "%s", msg);
    }
    w->n++;
}

Test(creds, uri_warnings) {
    struct warned w = {0};
    bd_mongo_uri_warnings("mongodb://h/?tls=true&tlsInsecure=true", "mongodb.uri", note, &w);
    cr_assert_eq(w.n, 1);
    cr_assert(strstr(w.text[0], "mongodb.uri: tlsInsecure=true") != NULL, "%s", w.text[0]);
    w = (struct warned){0};
    bd_mongo_uri_warnings("mongodb://u:p@db.example/?authMechanism=PLAIN", "mongodb.uri_file", note,
                          &w);
    cr_assert_eq(w.n, 1);
    cr_assert(strstr(w.text[0], "PLAIN") != NULL && strstr(w.text[0], "db.example") != NULL);
    w = (struct warned){0};
    bd_mongo_uri_warnings("mongodb://u:p@127.0.0.1,[::1]/", "mongodb.uri", note, &w);
    cr_assert_eq(w.n, 0);
    bd_mongo_uri_warnings("mongodb://u:p@db.example/?tls=true", "mongodb.uri", note, &w);
    cr_assert_eq(w.n, 0);
}

static const char *config(const char *mongodb, mode_t mode) {
    char text[1024];
    snprintf(text, sizeof(text),
             "listeners:\n  - proto: udp\n    bind: \"127.0.0.1:8089\"\nmongodb:\n%s", mongodb);
    return put("bucketd.yaml", text, mode);
}

static char *dump(const struct bd_config *cfg) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert_eq(bd_config_dump(cfg, f), 0);
    fclose(f);
    return text;
}

Test(creds, config_password_file_and_redacted_dump) {
    static struct bd_config cfg;
    struct bd_err err = {0};
    put("pw", "top secret\n", 0600);
    const char *path = config("  uri: \"mongodb://bucketd@db1/?tls=true\"\n"
                              "  password_file: pw\n",
                              0600);
    cr_assert_eq(bd_config_load(&cfg, path, &err), 0, "%s", err.msg);
    cr_assert_str_eq(cfg.mongodb.uri, "mongodb://bucketd:top%20secret@db1/?tls=true");
    char *text = dump(&cfg);
    cr_assert(strstr(text, "secret") == NULL, "%s", text);
    cr_assert(strstr(text, "password_file: \"pw\"") != NULL, "%s", text);
    free(text);

    config("  uri: \"mongodb://bucketd:inline@db1/\"\n", 0600);
    cr_assert_eq(bd_config_load(&cfg, path, &err), 0, "%s", err.msg);
    text = dump(&cfg);
    cr_assert(strstr(text, "inline") == NULL, "%s", text);
    cr_assert(strstr(text, "uri: \"mongodb://bucketd:*****@db1/\"") != NULL, "%s", text);
    free(text);
}

struct changes {
    char text[1024];
};

static void on_change(void *arg, const struct bd_config_change *c) {
    struct changes *ch = arg;
    size_t n = strlen(ch->text);
    snprintf(ch->text + n, sizeof(ch->text) - n, "%s|%s|%s|%s\n", c->key, c->from, c->to,
             c->applied ? "applied" : "restart");
}

Test(creds, config_uri_file_and_reload_of_a_changed_file) {
    static struct bd_config cur, next, out;
    struct bd_err err = {0};
    put("mongodb-uri", "mongodb://u:first@127.0.0.1/\n", 0600);
    const char *path = config("  uri_file: mongodb-uri\n", 0600);
    cr_assert_eq(bd_config_load(&cur, path, &err), 0, "%s", err.msg);
    cr_assert_str_eq(cur.mongodb.uri, "mongodb://u:first@127.0.0.1/");
    char *text = dump(&cur);
    cr_assert(strstr(text, "first") == NULL, "%s", text);
    cr_assert(strstr(text, "  uri:") == NULL, "%s", text);
    free(text);

    put("mongodb-uri", "mongodb://u:second@127.0.0.1/\n", 0600);
    cr_assert_eq(bd_config_load(&next, path, &err), 0, "%s", err.msg);
    struct changes ch = {{0}};
    cr_assert_eq(bd_config_reload_merge(&cur, &next, &out, on_change, &ch, &err), 0);
    cr_assert_str_eq(ch.text, "mongodb.uri_file (its content)|(not shown)|(changed)|restart\n");
    cr_assert_str_eq(out.mongodb.uri, "mongodb://u:first@127.0.0.1/");

    /* The file's path is found in $CREDENTIALS_DIRECTORY first. */
    setenv("CREDENTIALS_DIRECTORY", "/nonexistent-creds", 1);
    cr_assert_lt(bd_config_load(&next, path, &err), 0);
    cr_assert(strstr(err.msg, "mongodb.uri_file: "
                              "/nonexistent-creds/mongodb-uri: No such file") != NULL,
              "%s", err.msg);
    unsetenv("CREDENTIALS_DIRECTORY");
}

static void count_warning(void *arg, const char *msg) {
    (void)msg;
    (*(int *)arg)++;
}

Test(creds, config_warnings_name_the_exposed_file) {
    static struct bd_config cfg;
    struct bd_err err = {0};
    int n = 0;
    const char *path = config("  uri: \"mongodb://u:p@127.0.0.1/\"\n", 0644);
    cr_assert_eq(bd_config_load(&cfg, path, &err), 0, "%s", err.msg);
    bd_config_warnings(&cfg, count_warning, &n);
    cr_assert_eq(n, 1);
    chmod(path, 0600);
    n = 0;
    bd_config_warnings(&cfg, count_warning, &n);
    cr_assert_eq(n, 0);
    /* Without a password in it, a readable config is fine. */
    config("  uri: \"mongodb://127.0.0.1/\"\n", 0644);
    cr_assert_eq(bd_config_load(&cfg, path, &err), 0, "%s", err.msg);
    bd_config_warnings(&cfg, count_warning, &n);
    cr_assert_eq(n, 0);
}
