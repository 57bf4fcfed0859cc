/*
 * TLS for TCP listeners with OpenSSL (include/bucketd/tls.h). A context is one SSL_CTX, built
 * when the configuration is loaded (to validate it) and again when a listener opens or a reload
 * reads its certificate anew; a connection is one SSL between two memory BIOs: the caller feeds
 * the ciphertext it read into rbio and sends what appears in wbio, so the ingest thread's libuv
 * streams stay the only I/O and OpenSSL never blocks.
 *
 * Ownership: an SSL holds its own reference to its SSL_CTX, so a context replaced by a reload
 * lives on until its last connection closes. Nothing here is shared between threads except the
 * reference counts, which OpenSSL keeps atomically.
 */
#include "bucketd/tls.h"

#include <errno.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* OpenSSL's reason for a failed connection, kept for the log. */
#define REASON_LEN 160

struct bd_tls_ctx {
    SSL_CTX *ssl;
};

struct bd_tls {
    SSL *ssl;
    BIO *rbio; /* ciphertext from the peer; owned by ssl */
    BIO *wbio; /* ciphertext for the peer; owned by ssl */
    bool failed;
    char reason[REASON_LEN];
};

/* The first error on the queue (the cause; later ones are the callers giving up) as text. */
static void last_error(char *buf, size_t cap) {
    unsigned long e = ERR_peek_error();
    if (e == 0) {
        snprintf(buf, cap, "unknown error");
        return;
    }
    const char *reason = ERR_reason_error_string(e);
    if (reason != NULL) {
        snprintf(buf, cap, "%s", reason);
    } else {
        ERR_error_string_n(e, buf, cap);
    }
}

/* An encrypted key must fail to load, never prompt on a terminal for its passphrase. */
static int no_password(char *buf, int size, int rwflag, void *arg) {
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)arg;
    return -1;
}

bool bd_tls_enabled(const struct bd_listener_config *lc) {
    return lc->proto == BD_PROTO_TCP && lc->tls.cert[0] != '\0';
}

/* The file must open for reading: errno's message says more than OpenSSL's for a bad path. */
static int readable(const char *path, struct bd_err *err) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return bd_err_set(err, -errno, "cannot read '%s': %s", path, strerror(errno));
    }
    fclose(f);
    return 0;
}

int bd_tls_ctx_new(struct bd_tls_ctx **out, const struct bd_listener_config *lc, const char **key,
                   struct bd_err *err) {
    struct bd_tls_ctx *ctx = NULL;
    STACK_OF(X509_NAME) *names = NULL;
    char why[REASON_LEN];
    int rc = 0;

    *out = NULL;
    *key = "cert";
    ERR_clear_error();
    ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        rc = bd_err_set(err, -ENOMEM, "out of memory");
        goto out;
    }
    ctx->ssl = SSL_CTX_new(TLS_server_method());
    if (ctx->ssl == NULL) {
        last_error(why, sizeof(why));
        rc = bd_err_set(err, -ENOMEM, "cannot create a TLS context: %s", why);
        goto out;
    }
    SSL_CTX_set_min_proto_version(ctx->ssl, TLS1_2_VERSION);
    /*
     * No renegotiation (TLS 1.2; 1.3 has none) and no compression (CRIME). No resumption: the
     * senders hold one long connection each, so tickets and a session cache would only be state
     * to keep and, with client_ca, one more path around the certificate check.
     */
    SSL_CTX_set_options(ctx->ssl, SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION |
                                      SSL_OP_NO_TICKET | SSL_OP_CIPHER_SERVER_PREFERENCE);
    SSL_CTX_set_session_cache_mode(ctx->ssl, SSL_SESS_CACHE_OFF);
    /* An idle connection (most of them, between readings) gives its record buffers back. */
    SSL_CTX_set_mode(ctx->ssl, SSL_MODE_RELEASE_BUFFERS);
    SSL_CTX_set_num_tickets(ctx->ssl, 0);
    /* TLS 1.2: forward secrecy and AEAD only (1.3's suites are all that already). */
    if (SSL_CTX_set_cipher_list(ctx->ssl, "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM") != 1) {
        last_error(why, sizeof(why));
        rc = bd_err_set(err, -EINVAL, "cannot set the TLS 1.2 ciphers: %s", why);
        goto out;
    }
    SSL_CTX_set_default_passwd_cb(ctx->ssl, no_password);

    rc = readable(lc->tls.cert, err);
    if (rc < 0) {
        goto out;
    }
    if (SSL_CTX_use_certificate_chain_file(ctx->ssl, lc->tls.cert) != 1) {
        last_error(why, sizeof(why));
        rc = bd_err_set(err, -EINVAL, "'%s' is not a PEM certificate chain: %s", lc->tls.cert, why);
        goto out;
    }
    *key = "key";
    rc = readable(lc->tls.key, err);
    if (rc < 0) {
        goto out;
    }
    if (SSL_CTX_use_PrivateKey_file(ctx->ssl, lc->tls.key, SSL_FILETYPE_PEM) != 1) {
        if (ERR_GET_REASON(ERR_peek_last_error()) == X509_R_KEY_VALUES_MISMATCH) {
            rc = bd_err_set(err, -EINVAL, "'%s' does not match the certificate in '%s'",
                            lc->tls.key, lc->tls.cert);
            goto out;
        }
        last_error(why, sizeof(why));
        rc = bd_err_set(err, -EINVAL,
                        "'%s' is not an unencrypted PEM private key for the certificate: %s",
                        lc->tls.key, why);
        goto out;
    }
    if (SSL_CTX_check_private_key(ctx->ssl) != 1) {
        rc = bd_err_set(err, -EINVAL, "'%s' does not match the certificate in '%s'", lc->tls.key,
                        lc->tls.cert);
        goto out;
    }
    if (lc->tls.client_ca[0] != '\0') {
        *key = "client_ca";
        rc = readable(lc->tls.client_ca, err);
        if (rc < 0) {
            goto out;
        }
        names = SSL_load_client_CA_file(lc->tls.client_ca);
        if (names == NULL ||
            SSL_CTX_load_verify_locations(ctx->ssl, lc->tls.client_ca, NULL) != 1) {
            last_error(why, sizeof(why));
            rc = bd_err_set(err, -EINVAL, "'%s' holds no PEM CA certificate: %s", lc->tls.client_ca,
                            why);
            goto out;
        }
        /* The CA names go into the certificate request, so a client can pick its certificate. */
        SSL_CTX_set_client_CA_list(ctx->ssl, names);
        names = NULL;
        SSL_CTX_set_verify(ctx->ssl, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    }
    *key = NULL;
    *out = ctx;
    ctx = NULL;
out:
    if (names != NULL) {
        sk_X509_NAME_pop_free(names, X509_NAME_free);
    }
    bd_tls_ctx_free(ctx);
    ERR_clear_error();
    return rc;
}

bool bd_tls_ctx_expiry(const struct bd_tls_ctx *ctx, char *buf, size_t cap) {
    X509 *cert = SSL_CTX_get0_certificate(ctx->ssl);
    const ASN1_TIME *end = cert != NULL ? X509_get0_notAfter(cert) : NULL;
    struct tm tm;
    if (end == NULL || ASN1_TIME_to_tm(end, &tm) != 1) {
        snprintf(buf, cap, "unknown");
        return false;
    }
    strftime(buf, cap, "%Y-%m-%d %H:%M:%S UTC", &tm);
    return X509_cmp_current_time(end) < 0;
}

void bd_tls_ctx_free(struct bd_tls_ctx *ctx) {
    if (ctx != NULL) {
        SSL_CTX_free(ctx->ssl);
        free(ctx);
    }
}

int bd_tls_new(struct bd_tls **out, struct bd_tls_ctx *ctx) {
    struct bd_tls *t = NULL;
    int rc = 0;

    *out = NULL;
    ERR_clear_error();
    t = calloc(1, sizeof(*t));
    if (t == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    t->ssl = SSL_new(ctx->ssl);
    t->rbio = BIO_new(BIO_s_mem());
    t->wbio = BIO_new(BIO_s_mem());
    if (t->ssl == NULL || t->rbio == NULL || t->wbio == NULL) {
        BIO_free(t->rbio);
        BIO_free(t->wbio);
        t->rbio = t->wbio = NULL;
        rc = -ENOMEM;
        goto out;
    }
    /* An empty rbio means "wait for more", not end of stream. */
    BIO_set_mem_eof_return(t->rbio, -1);
    SSL_set_bio(t->ssl, t->rbio, t->wbio);
    SSL_set_accept_state(t->ssl);
    *out = t;
    t = NULL;
out:
    bd_tls_free(t);
    ERR_clear_error();
    return rc;
}

void bd_tls_free(struct bd_tls *t) {
    if (t != NULL) {
        SSL_free(t->ssl); /* and both BIOs */
        free(t);
    }
}

int bd_tls_feed(struct bd_tls *t, const void *data, size_t len) {
    while (len > 0) {
        int chunk = len > (size_t)INT32_MAX ? INT32_MAX : (int)len;
        int n = BIO_write(t->rbio, data, chunk);
        if (n <= 0) {
            ERR_clear_error();
            return -ENOMEM;
        }
        data = (const char *)data + n;
        len -= (size_t)n;
    }
    return 0;
}

ssize_t bd_tls_read(struct bd_tls *t, char *buf, size_t cap) {
    if (t->failed) {
        return BD_TLS_FAILED;
    }
    ERR_clear_error();
    int chunk = cap > (size_t)INT32_MAX ? INT32_MAX : (int)cap;
    int n = SSL_read(t->ssl, buf, chunk);
    if (n > 0) {
        return n;
    }
    int e = SSL_get_error(t->ssl, n);
    switch (e) {
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE: /* a memory wbio always takes more; treated as "need input" */
        return 0;
    case SSL_ERROR_ZERO_RETURN:
        return BD_TLS_CLOSED;
    default:
        break;
    }
    t->failed = true;
    if (e == SSL_ERROR_SSL) {
        int why = ERR_GET_REASON(ERR_peek_error());
        last_error(t->reason, sizeof(t->reason));
        /* What OpenSSL makes of a line of text where a TLS record header belongs. */
        if (why == SSL_R_WRONG_VERSION_NUMBER || why == SSL_R_HTTP_REQUEST ||
            why == SSL_R_HTTPS_PROXY_REQUEST) {
            size_t used = strlen(t->reason);
            snprintf(t->reason + used, sizeof(t->reason) - used,
                     " (not TLS: a plain-text client?)");
        }
        long v = SSL_get_verify_result(t->ssl);
        if (v != X509_V_OK) {
            size_t used = strlen(t->reason);
            snprintf(t->reason + used, sizeof(t->reason) - used, " (%s)",
                     X509_verify_cert_error_string(v));
        }
    } else {
        snprintf(t->reason, sizeof(t->reason), "protocol error (SSL_get_error %d)", e);
    }
    ERR_clear_error();
    return BD_TLS_FAILED;
}

bool bd_tls_established(const struct bd_tls *t) {
    return SSL_is_init_finished(t->ssl) != 0;
}

size_t bd_tls_unread(const struct bd_tls *t) {
    return BIO_ctrl_pending(t->rbio) + (size_t)SSL_pending(t->ssl);
}

size_t bd_tls_output_len(const struct bd_tls *t) {
    return BIO_ctrl_pending(t->wbio);
}

size_t bd_tls_take_output(struct bd_tls *t, char *buf, size_t cap) {
    int chunk = cap > (size_t)INT32_MAX ? INT32_MAX : (int)cap;
    int n = BIO_read(t->wbio, buf, chunk);
    ERR_clear_error();
    return n > 0 ? (size_t)n : 0;
}

void bd_tls_shutdown(struct bd_tls *t) {
    if (!t->failed && SSL_is_init_finished(t->ssl)) {
        (void)SSL_shutdown(t->ssl);
    }
    ERR_clear_error();
}

const char *bd_tls_reason(const struct bd_tls *t) {
    return t->reason;
}
