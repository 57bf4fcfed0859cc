/*
 * Unit tests for src/tls.c: the server context's errors, and sessions driven over memory BIOs
 * against an OpenSSL client in the same process (no sockets, no threads): what the client writes
 * comes out as the same plaintext however it is split, close_notify ends the stream, and plain
 * text, a missing client certificate or one of another CA fail the handshake with a reason.
 * Certificates are made per test under a private mkdtemp directory (tls_certs.h).
 */
#include <criterion/criterion.h>

#include <errno.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucketd/tls.h"
#include "tls_certs.h"

static char dir[256];

static void path_of(char *out, size_t cap, const char *name) {
    snprintf(out, cap, "%s/%s", dir, name);
}

static void setup(void) {
    const char *base = getenv("TMPDIR");
    snprintf(dir, sizeof(dir), "%s/bd-tls-XXXXXX", base != NULL ? base : "/tmp");
    cr_assert_not_null(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
    struct test_cert ca = test_cert_make("test ca", NULL);
    struct test_cert other = test_cert_make("other ca", NULL);
    struct test_cert server = test_cert_make("localhost", &ca);
    struct test_cert client = test_cert_make("client", &ca);
    struct test_cert stranger = test_cert_make("stranger", &other);
    struct test_cert expired = test_cert_make("localhost", &ca);
    X509_gmtime_adj(X509_getm_notAfter(expired.cert), -60);
    cr_assert_gt(X509_sign(expired.cert, ca.key, EVP_sha256()), 0);
    test_cert_write(&expired, dir, "expired");
    test_cert_free(&expired);
    test_cert_write(&ca, dir, "ca");
    test_cert_write(&server, dir, "server");
    test_cert_write(&client, dir, "client");
    test_cert_write(&stranger, dir, "stranger");
    test_cert_free(&ca);
    test_cert_free(&other);
    test_cert_free(&server);
    test_cert_free(&client);
    test_cert_free(&stranger);
    char p[300];
    path_of(p, sizeof(p), "junk.pem");
    FILE *f = fopen(p, "w");
    cr_assert_not_null(f);
    fputs("weather,site=roof temp=21.5\n", f);
    fclose(f);
}

static void teardown(void) {
    const char *names[] = {"ca.pem",     "ca.key",      "server.pem",   "server.key",
                           "client.pem", "client.key",  "stranger.pem", "stranger.key",
                           "junk.pem",   "expired.pem", "expired.key"};
    char p[300];
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        path_of(p, sizeof(p), names[i]);
        unlink(p);
    }
    rmdir(dir);
}

TestSuite(tls, .init = setup, .fini = teardown);

static void listener(struct bd_listener_config *lc, const char *cert, const char *key,
                     const char *client_ca) {
    memset(lc, 0, sizeof(*lc));
    lc->proto = BD_PROTO_TCP;
    path_of(lc->tls.cert, sizeof(lc->tls.cert), cert);
    path_of(lc->tls.key, sizeof(lc->tls.key), key);
    if (client_ca != NULL) {
        path_of(lc->tls.client_ca, sizeof(lc->tls.client_ca), client_ca);
    }
}

static struct bd_tls_ctx *server_ctx(const char *client_ca) {
    struct bd_listener_config lc;
    struct bd_tls_ctx *ctx = NULL;
    struct bd_err err = {0};
    const char *key = NULL;
    listener(&lc, "server.pem", "server.key", client_ca);
    cr_assert_eq(bd_tls_ctx_new(&ctx, &lc, &key, &err), 0, "%s: %s", key, err.msg);
    cr_assert_null(key);
    return ctx;
}

static void expect_ctx_error(const char *cert, const char *key, const char *client_ca,
                             const char *want_key, const char *needle) {
    struct bd_listener_config lc;
    struct bd_tls_ctx *ctx = NULL;
    struct bd_err err = {0};
    const char *bad = NULL;
    listener(&lc, cert, key, client_ca);
    cr_assert_lt(bd_tls_ctx_new(&ctx, &lc, &bad, &err), 0);
    cr_assert_null(ctx);
    cr_assert_not_null(bad);
    cr_assert_str_eq(bad, want_key);
    cr_assert_not_null(strstr(err.msg, needle), "\"%s\" lacks \"%s\"", err.msg, needle);
}

Test(tls, context_errors_name_the_key_and_the_cause) {
    expect_ctx_error("missing.pem", "server.key", NULL, "cert", "No such file or directory");
    expect_ctx_error("junk.pem", "server.key", NULL, "cert", "not a PEM certificate");
    expect_ctx_error("server.pem", "missing.key", NULL, "key", "No such file or directory");
    expect_ctx_error("server.pem", "client.key", NULL, "key", "does not match the certificate");
    expect_ctx_error("server.pem", "junk.pem", NULL, "key", "not an unencrypted PEM private key");
    expect_ctx_error("server.pem", "server.key", "missing.pem", "client_ca", "No such file");
    expect_ctx_error("server.pem", "server.key", "junk.pem", "client_ca", "no PEM CA certificate");
    bd_tls_ctx_free(server_ctx(NULL));
    bd_tls_ctx_free(server_ctx("ca.pem"));
    bd_tls_ctx_free(NULL);
}

Test(tls, the_certificate_expiry_is_reported) {
    struct bd_listener_config lc;
    struct bd_tls_ctx *ctx = server_ctx(NULL);
    struct bd_err err = {0};
    const char *key = NULL;
    char until[64];
    cr_assert_not(bd_tls_ctx_expiry(ctx, until, sizeof(until)));
    cr_assert_not_null(strstr(until, " UTC"), "%s", until);
    bd_tls_ctx_free(ctx);
    /* An expired certificate still loads (clients decide), but says so. */
    listener(&lc, "expired.pem", "expired.key", NULL);
    cr_assert_eq(bd_tls_ctx_new(&ctx, &lc, &key, &err), 0, "%s", err.msg);
    cr_assert(bd_tls_ctx_expiry(ctx, until, sizeof(until)));
    bd_tls_ctx_free(ctx);
}

/* An OpenSSL client over memory BIOs, trusting ca.pem, with an optional certificate. */
struct client {
    SSL_CTX *ctx;
    SSL *ssl;
    BIO *in, *out; /* in: from the server; out: to the server */
};

static void client_open(struct client *c, const char *cert) {
    char p[300], k[300];
    c->ctx = SSL_CTX_new(TLS_client_method());
    cr_assert_not_null(c->ctx);
    path_of(p, sizeof(p), "ca.pem");
    cr_assert_eq(SSL_CTX_load_verify_locations(c->ctx, p, NULL), 1);
    SSL_CTX_set_verify(c->ctx, SSL_VERIFY_PEER, NULL);
    if (cert != NULL) {
        snprintf(p, sizeof(p), "%s/%s.pem", dir, cert);
        snprintf(k, sizeof(k), "%s/%s.key", dir, cert);
        cr_assert_eq(SSL_CTX_use_certificate_file(c->ctx, p, SSL_FILETYPE_PEM), 1);
        cr_assert_eq(SSL_CTX_use_PrivateKey_file(c->ctx, k, SSL_FILETYPE_PEM), 1);
    }
    c->ssl = SSL_new(c->ctx);
    c->in = BIO_new(BIO_s_mem());
    c->out = BIO_new(BIO_s_mem());
    BIO_set_mem_eof_return(c->in, -1);
    SSL_set_bio(c->ssl, c->in, c->out);
    SSL_set_connect_state(c->ssl);
    SSL_set_tlsext_host_name(c->ssl, "localhost");
}

static void client_close(struct client *c) {
    SSL_free(c->ssl);
    SSL_CTX_free(c->ctx);
}

/* What the server made of the client's bytes so far. */
struct sink {
    char *buf;
    size_t len, cap;
    int last; /* last bd_tls_read() result that was not > 0 */
};

/*
 * Move bytes both ways until neither side has anything more to say: the client's output is fed
 * to the server `step` bytes at a time (0: all at once) and the plaintext collected.
 */
static void exchange(struct client *c, struct bd_tls *t, struct sink *s, size_t step) {
    char buf[4096];
    for (int round = 0; round < 64; round++) {
        bool moved = false;
        if (!SSL_is_init_finished(c->ssl)) {
            (void)SSL_do_handshake(c->ssl);
        }
        int n;
        while ((n = BIO_read(c->out, buf, sizeof(buf))) > 0) {
            moved = true;
            for (size_t off = 0; off < (size_t)n;) {
                size_t len = step == 0 ? (size_t)n - off : BD_MIN(step, (size_t)n - off);
                cr_assert_eq(bd_tls_feed(t, buf + off, len), 0);
                off += len;
                ssize_t r;
                while ((r = bd_tls_read(t, s->buf + s->len, s->cap - s->len)) > 0) {
                    s->len += (size_t)r;
                }
                s->last = (int)r;
            }
        }
        size_t k;
        while ((k = bd_tls_take_output(t, buf, sizeof(buf))) > 0) {
            moved = true;
            cr_assert_eq(BIO_write(c->in, buf, (int)k), (int)k);
        }
        char sink[256];
        while (SSL_is_init_finished(c->ssl) && SSL_read(c->ssl, sink, sizeof(sink)) > 0) {
        }
        ERR_clear_error();
        if (!moved) {
            return;
        }
    }
    cr_assert_fail("the exchange did not settle");
}

static void session(const char *client_ca, const char *client_cert, size_t step, size_t bytes) {
    struct bd_tls_ctx *ctx = server_ctx(client_ca);
    struct bd_tls *t = NULL;
    struct client c;
    struct sink s = {.cap = bytes + 1};
    s.buf = malloc(s.cap);
    char *sent = malloc(bytes);
    cr_assert(s.buf != NULL && sent != NULL);
    for (size_t i = 0; i < bytes; i++) {
        sent[i] = (i % 61 == 60) ? '\n' : (char)('a' + i % 26);
    }

    cr_assert_eq(bd_tls_new(&t, ctx), 0);
    bd_tls_ctx_free(ctx); /* the session keeps its own reference */
    client_open(&c, client_cert);
    exchange(&c, t, &s, step);
    cr_assert(SSL_is_init_finished(c.ssl));
    cr_assert(bd_tls_established(t));
    for (size_t off = 0; off < bytes;) {
        int n = SSL_write(c.ssl, sent + off, (int)BD_MIN(bytes - off, (size_t)10000));
        cr_assert_gt(n, 0);
        off += (size_t)n;
        exchange(&c, t, &s, step);
    }
    cr_assert_eq(s.len, bytes);
    cr_assert_eq(memcmp(s.buf, sent, bytes), 0);
    cr_assert_eq(s.last, 0);
    SSL_shutdown(c.ssl);
    exchange(&c, t, &s, step);
    cr_assert_eq(s.last, BD_TLS_CLOSED);
    cr_assert_eq(bd_tls_unread(t), 0);
    cr_assert_str_eq(bd_tls_reason(t), "");

    client_close(&c);
    bd_tls_free(t);
    free(sent);
    free(s.buf);
}

Test(tls, plaintext_comes_out_as_sent_and_close_notify_ends_it) {
    session(NULL, NULL, 0, 300000);
}

Test(tls, ciphertext_fed_a_few_bytes_at_a_time) {
    session(NULL, NULL, 7, 20000);
}

Test(tls, a_trusted_client_certificate_is_accepted) {
    session("ca.pem", "client", 0, 5000);
}

/* The handshake fails: the server has no plaintext, a reason, and is not established. */
static void expect_refused(const char *client_ca, const char *client_cert, const char *needle) {
    struct bd_tls_ctx *ctx = server_ctx(client_ca);
    struct bd_tls *t = NULL;
    struct client c;
    struct sink s = {.cap = 4096};
    s.buf = malloc(s.cap);
    cr_assert_eq(bd_tls_new(&t, ctx), 0);
    client_open(&c, client_cert);
    exchange(&c, t, &s, 0);
    /* TLS 1.3: the client is done before the server has checked its certificate. */
    if (SSL_is_init_finished(c.ssl)) {
        cr_assert_gt(SSL_write(c.ssl, "x v=1\n", 6), 0);
        exchange(&c, t, &s, 0);
    }
    cr_assert_eq(s.len, 0);
    cr_assert_eq(s.last, BD_TLS_FAILED);
    cr_assert_not(bd_tls_established(t));
    cr_assert_not_null(strstr(bd_tls_reason(t), needle), "reason \"%s\" lacks \"%s\"",
                       bd_tls_reason(t), needle);
    client_close(&c);
    bd_tls_free(t);
    bd_tls_ctx_free(ctx);
    free(s.buf);
}

Test(tls, a_missing_client_certificate_fails_the_handshake) {
    expect_refused("ca.pem", NULL, "certificate");
}

Test(tls, a_client_certificate_of_another_ca_fails_the_handshake) {
    expect_refused("ca.pem", "stranger", "certificate");
}

Test(tls, plain_text_fails_the_handshake) {
    struct bd_tls_ctx *ctx = server_ctx(NULL);
    struct bd_tls *t = NULL;
    char buf[256];
    cr_assert_eq(bd_tls_new(&t, ctx), 0);
    const char *line = "weather,site=roof temp=21.5 1736949600000000000\n";
    cr_assert_eq(bd_tls_feed(t, line, strlen(line)), 0);
    cr_assert_eq(bd_tls_read(t, buf, sizeof(buf)), BD_TLS_FAILED);
    cr_assert_not_null(strstr(bd_tls_reason(t), "plain-text client"), "%s", bd_tls_reason(t));
    cr_assert_not(bd_tls_established(t));
    /* Failed stays failed: nothing more comes out of the session. */
    cr_assert_eq(bd_tls_read(t, buf, sizeof(buf)), BD_TLS_FAILED);
    bd_tls_free(t);
    bd_tls_ctx_free(ctx);
}

Test(tls, a_partial_hello_waits_for_more) {
    struct bd_tls_ctx *ctx = server_ctx(NULL);
    struct bd_tls *t = NULL;
    char buf[256];
    cr_assert_eq(bd_tls_new(&t, ctx), 0);
    /* The first bytes of a TLS record header: handshake, TLS 1.0 record version. */
    cr_assert_eq(bd_tls_feed(t, "\x16\x03\x01", 3), 0);
    cr_assert_eq(bd_tls_read(t, buf, sizeof(buf)), 0);
    cr_assert_eq(bd_tls_output_len(t), 0);
    bd_tls_free(t);
    bd_tls_ctx_free(ctx);
}
