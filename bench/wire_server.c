/*
 * wire_server: the most this machine's load generator can drive at depth 1.
 *
 * Not a broker: it frames bench/loadgen.c's commands (lines, and a put's body) and
 * answers each with a constant reply (INSERTED 1, RESERVED 1 with a 100-byte body,
 * DELETED, USING, WATCHING), keeping no jobs. It does per command only what any server
 * on this kernel must: one recv and one send a ready connection. It also does what our
 * compiled broker does to cost the generator less: it busy-polls for a while after a
 * command instead of sleeping (so the generator's sends seldom have a sleeper to wake),
 * and it holds the replies of a poll's ready connections and sends them back to back
 * after every 32 connections (so the generator, woken by the first, finds the rest).
 *
 * Why: on a 2-core machine the server and the load generator get one core each, and a
 * loopback send runs the receiver's TCP input in the sender's context, so the generator
 * pays about as much kernel time a command as the server. A server that costs less than
 * the generator cannot show it: its throughput is the generator's. This server's
 * throughput is that bound; a row's ours / wire says how close to it ours gets.
 *
 *     wire_server PORT [BUSY_POLL_US]      (default 100 us, as our broker)
 *
 * Build: gcc -O2 -Wall -o bench/bin/wire_server bench/wire_server.c (bench/servers.py does it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_EVENTS 256
#define BATCH 32
#define READ_SIZE 65536

static const char RESERVED[] =
    "RESERVED 1 100\r\n"
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\r\n";

typedef struct {
    int fd;
    char *in;      /* a partial line carried to the next read */
    size_t inlen, incap;
    size_t need;   /* body bytes (with their CRLF) a put still owes */
    char *out;     /* replies not yet sent */
    size_t outlen, outcap;
    int held;      /* on the batch list */
    int writing;   /* EPOLLOUT is on: the socket's buffer was full */
} conn_t;

static int ep;
static conn_t **dead;  /* closed in this poll; freed once the poll's events and batch are done */
static size_t ndead, capdead;

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n);
    if (!q) { perror("realloc"); exit(1); }
    return q;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void append(char **buf, size_t *len, size_t *cap, const char *data, size_t n) {
    if (*len + n > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *len + n) c *= 2;
        *buf = xrealloc(*buf, c);
        *cap = c;
    }
    memcpy(*buf + *len, data, n);
    *len += n;
}

static void close_conn(conn_t *c) {
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    if (ndead == capdead) {
        capdead = capdead ? capdead * 2 : 64;
        dead = xrealloc(dead, capdead * sizeof *dead);
    }
    dead[ndead++] = c;
}

static void free_dead(void) {
    for (size_t i = 0; i < ndead; i++) {
        free(dead[i]->in);
        free(dead[i]->out);
        free(dead[i]);
    }
    ndead = 0;
}

/* One command line (without CRLF): append its reply. */
static void answer(conn_t *c, const char *line, size_t len) {
    if (len > 4 && memcmp(line, "put ", 4) == 0) {
        const char *sp = memrchr(line, ' ', len);
        c->need = (size_t)strtoul(sp + 1, NULL, 10) + 2;
    } else if (len >= 7 && memcmp(line, "reserve", 7) == 0) {
        append(&c->out, &c->outlen, &c->outcap, RESERVED, sizeof RESERVED - 1);
    } else if (len >= 6 && memcmp(line, "delete", 6) == 0) {
        append(&c->out, &c->outlen, &c->outcap, "DELETED\r\n", 9);
    } else if (len > 4 && memcmp(line, "use ", 4) == 0) {
        append(&c->out, &c->outlen, &c->outcap, "USING ", 6);
        append(&c->out, &c->outlen, &c->outcap, line + 4, len - 4);
        append(&c->out, &c->outlen, &c->outcap, "\r\n", 2);
    } else if ((len > 6 && memcmp(line, "watch ", 6) == 0) || (len > 7 && memcmp(line, "ignore ", 7) == 0)) {
        append(&c->out, &c->outlen, &c->outcap, "WATCHING 1\r\n", 12);
    } else {
        append(&c->out, &c->outlen, &c->outcap, "UNKNOWN_COMMAND\r\n", 17);
    }
}

/* Frame what arrived: bodies owed, then whole lines; keep a partial line. */
static void frame(conn_t *c, const char *data, size_t n) {
    if (c->inlen) {  /* rare: a line split across reads */
        append(&c->in, &c->inlen, &c->incap, data, n);
        data = c->in;
        n = c->inlen;
    }
    size_t pos = 0;
    while (pos < n) {
        if (c->need) {
            size_t take = n - pos < c->need ? n - pos : c->need;
            pos += take;
            c->need -= take;
            if (!c->need) append(&c->out, &c->outlen, &c->outcap, "INSERTED 1\r\n", 12);
            continue;
        }
        const char *eol = memmem(data + pos, n - pos, "\r\n", 2);
        if (!eol) break;
        answer(c, data + pos, (size_t)(eol - (data + pos)));
        pos = (size_t)(eol - data) + 2;
    }
    size_t rest = n - pos;
    if (data == c->in) {
        memmove(c->in, c->in + pos, rest);
        c->inlen = rest;
    } else if (rest) {
        append(&c->in, &c->inlen, &c->incap, data + pos, rest);
    }
}

/* Send what a connection owes; on a full socket buffer keep the rest and wait for EPOLLOUT. */
static void flush(conn_t *c) {
    size_t off = 0;
    while (off < c->outlen) {
        ssize_t w = send(c->fd, c->out + off, c->outlen - off, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) break;
            close_conn(c);
            return;
        }
        off += (size_t)w;
    }
    memmove(c->out, c->out + off, c->outlen - off);
    c->outlen -= off;
    int want = c->outlen > 0;
    if (want != c->writing) {
        struct epoll_event ev = {.events = EPOLLIN | (want ? EPOLLOUT : 0), .data.ptr = c};
        epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
        c->writing = want;
    }
}

static void send_batch(conn_t **batch, int *n) {
    for (int i = 0; i < *n; i++) {
        conn_t *c = batch[i];
        c->held = 0;
        if (c->fd >= 0) flush(c);
    }
    *n = 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: wire_server PORT [BUSY_POLL_US]\n");
        return 2;
    }
    int port = atoi(argv[1]);
    uint64_t window = (uint64_t)(argc > 2 ? atoi(argv[2]) : 100) * 1000u;
    signal(SIGPIPE, SIG_IGN);
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(ls, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(ls, 4096) < 0) {
        perror("listen");
        return 1;
    }
    ep = epoll_create1(0);
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &lev);

    static char buf[READ_SIZE];
    struct epoll_event evs[MAX_EVENTS];
    conn_t *batch[BATCH];
    int nbatch = 0;
    uint64_t last = 0;  /* when a command last came; 0: not polling, sleep in epoll_wait */
    for (;;) {
        int n = epoll_wait(ep, evs, MAX_EVENTS, last ? 0 : -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            perror("epoll_wait");
            return 1;
        }
        if (n == 0) {
            if (now_ns() - last > window) last = 0;
            else sched_yield();
            continue;
        }
        for (int i = 0; i < n; i++) {
            conn_t *c = evs[i].data.ptr;
            if (!c) {
                int fd;
                while ((fd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn_t *nc = calloc(1, sizeof *nc);
                    if (!nc) { close(fd); continue; }
                    nc->fd = fd;
                    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = nc};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
                }
                continue;
            }
            if (c->fd < 0) continue;  /* closed earlier in this poll */
            if (evs[i].events & EPOLLOUT) flush(c);
            if (c->fd < 0 || !(evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) continue;
            ssize_t r = recv(c->fd, buf, sizeof buf, 0);
            if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (r <= 0) {
                close_conn(c);
                continue;
            }
            frame(c, buf, (size_t)r);
            if (c->outlen && !c->held) {
                c->held = 1;
                batch[nbatch++] = c;
                if (nbatch == BATCH) send_batch(batch, &nbatch);
            }
        }
        send_batch(batch, &nbatch);
        free_dead();
        last = now_ns();
    }
}
