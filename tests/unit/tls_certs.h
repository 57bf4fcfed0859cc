/*
 * Test certificates made with OpenSSL's API (no files shipped, no CLI needed): a P-256 key and a
 * certificate for it, self-signed or signed by another such pair, written as PEM files.
 * Header-only, for the unit tests of tls.c and of the listeners[].tls config keys.
 */
#ifndef BUCKETD_TESTS_TLS_CERTS_H
#define BUCKETD_TESTS_TLS_CERTS_H

#include <criterion/criterion.h>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <stdio.h>

struct test_cert {
    EVP_PKEY *key;
    X509 *cert;
};

/* A certificate for a new key with common name cn, signed by issuer (NULL: self-signed, a CA). */
static inline struct test_cert test_cert_make(const char *cn, const struct test_cert *issuer) {
    struct test_cert tc = {0};
    static long serial = 1;
    tc.key = EVP_EC_gen("P-256");
    cr_assert_not_null(tc.key);
    tc.cert = X509_new();
    cr_assert_not_null(tc.cert);
    X509_set_version(tc.cert, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(tc.cert), serial++);
    X509_gmtime_adj(X509_getm_notBefore(tc.cert), -3600);
    X509_gmtime_adj(X509_getm_notAfter(tc.cert), 2 * 86400);
    X509_set_pubkey(tc.cert, tc.key);
    X509_NAME *name = X509_get_subject_name(tc.cert);
    X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1, 0);
    X509_set_issuer_name(tc.cert, issuer != NULL ? X509_get_subject_name(issuer->cert) : name);
    if (issuer == NULL) {
        X509_EXTENSION *ext =
            X509V3_EXT_conf_nid(NULL, NULL, NID_basic_constraints, "critical,CA:TRUE");
        cr_assert_not_null(ext);
        X509_add_ext(tc.cert, ext, -1);
        X509_EXTENSION_free(ext);
    }
    cr_assert_gt(X509_sign(tc.cert, issuer != NULL ? issuer->key : tc.key, EVP_sha256()), 0);
    return tc;
}

static inline void test_cert_free(struct test_cert *tc) {
    EVP_PKEY_free(tc->key);
    X509_free(tc->cert);
    *tc = (struct test_cert){0};
}

/* Write dir/<name>.pem (the certificate) and dir/<name>.key (the unencrypted key). */
static inline void test_cert_write(const struct test_cert *tc, const char *dir, const char *name) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s.pem", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(PEM_write_X509(f, tc->cert), 1);
    cr_assert_eq(fclose(f), 0);
    snprintf(path, sizeof(path), "%s/%s.key", dir, name);
    f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(PEM_write_PrivateKey(f, tc->key, NULL, NULL, 0, NULL, NULL), 1);
    cr_assert_eq(fclose(f), 0);
}

#endif
