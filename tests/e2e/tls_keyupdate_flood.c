/*
 * A hostile TLS 1.3 client for tests/e2e/test_tls.py: it asks the server for a KeyUpdate again
 * and again (KeyUpdate with update_requested, each answered by one KeyUpdate of the server's)
 * and never reads what the server sends, with a comment line every so often, which a server
 * that keeps reading takes as a completed line (the idle timeout's sign of life). Python's ssl
 * module has no call for a KeyUpdate, so the test runs this program, linked to the same
 * OpenSSL as the daemon.
 *
 *   tls_keyupdate_flood HOST PORT UPDATES EVERY
 *
 * Connects with small socket buffers (so that the kernel holds little of either direction),
 * makes a TLS 1.3 handshake (the server's certificate is not checked: the test is about what
 * the server does after it), then sends UPDATES KeyUpdate requests and "# ...\n" after every
 * EVERY of them, blocking while the socket is full. Prints one line on stdout, "done N" when
 * all went out or "closed N REASON" when the server closed the connection after N, then keeps
 * the connection open until stdin reaches its end, so that the test can look at the server
 * while the connection still exists. Single-threaded; exits 0 on either outcome, 2 on a usage
 * or set-up error.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Socket buffers asked for (the kernel doubles and rounds them up to its minimum). */
#define SOCK_BUF 4096

static const char COMMENT[] = "# still here\n";

/* Why the last SSL call failed, for the report line. */
static const char *why(SSL *ssl, int rc) {
    static char buf[160];
    int e = SSL_get_error(ssl, rc);
    unsigned long q = ERR_peek_error();
    if (e == SSL_ERROR_SYSCALL) {
        snprintf(buf, sizeof(buf), "syscall:%s", errno != 0 ? strerror(errno) : "eof");
    } else if (q != 0) {
        snprintf(buf, sizeof(buf), "ssl:%s", ERR_reason_error_string(q));
    } else {
        snprintf(buf, sizeof(buf), "ssl_error:%d", e);
    }
    for (char *p = buf; *p != '\0'; p++) {
        if (*p == ' ') {
            *p = '_'; /* one word: the test splits the line on spaces */
        }
    }
    return buf;
}

static int connect_to(const char *host, const char *port) {
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port))};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        fprintf(stderr, "tls_keyupdate_flood: %s: not an IPv4 address\n", host);
        return -1;
    }
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        perror("tls_keyupdate_flood: socket");
        return -1;
    }
    int size = SOCK_BUF;
    /* Before connect: the receive window is agreed on in the handshake. */
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        perror("tls_keyupdate_flood: connect");
        close(fd);
        return -1;
    }
    return fd;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: tls_keyupdate_flood HOST PORT UPDATES EVERY\n");
        return 2;
    }
    long updates = atol(argv[3]);
    long every = atol(argv[4]);
    if (updates <= 0 || every <= 0) {
        fprintf(stderr, "tls_keyupdate_flood: UPDATES and EVERY must be positive\n");
        return 2;
    }
    /* A closed connection must show up as an error of the write, not kill the process. */
    signal(SIGPIPE, SIG_IGN);

    int fd = connect_to(argv[1], argv[2]);
    if (fd < 0) {
        return 2;
    }
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    if (ctx == NULL || SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) != 1) {
        fprintf(stderr, "tls_keyupdate_flood: cannot set up a TLS 1.3 context\n");
        return 2;
    }
    SSL *ssl = SSL_new(ctx);
    if (ssl == NULL || SSL_set_fd(ssl, fd) != 1) {
        fprintf(stderr, "tls_keyupdate_flood: cannot set up the session\n");
        return 2;
    }
    int rc = SSL_connect(ssl);
    if (rc != 1) {
        fprintf(stderr, "tls_keyupdate_flood: handshake failed: %s\n", why(ssl, rc));
        return 2;
    }

    long sent = 0;
    const char *ended = NULL;
    while (sent < updates && ended == NULL) {
        ERR_clear_error();
        errno = 0;
        if (SSL_key_update(ssl, SSL_KEY_UPDATE_REQUESTED) != 1) {
            ended = why(ssl, 0);
            break;
        }
        rc = SSL_do_handshake(ssl); /* sends the KeyUpdate; reads nothing */
        if (rc != 1) {
            ended = why(ssl, rc);
            break;
        }
        sent++;
        if (sent % every == 0) {
            rc = SSL_write(ssl, COMMENT, (int)strlen(COMMENT));
            if (rc <= 0) {
                ended = why(ssl, rc);
            }
        }
    }
    if (ended == NULL) {
        printf("done %ld\n", sent);
    } else {
        printf("closed %ld %s\n", sent, ended);
    }
    fflush(stdout);

    /* Hold the connection (and whatever the server queued for it) until the test is done. */
    char sink[64];
    while (read(STDIN_FILENO, sink, sizeof(sink)) > 0) {
    }
    SSL_free(ssl);
    SSL_CTX_free(ctx);
    close(fd);
    return 0;
}
