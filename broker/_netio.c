/* A plain-TCP transport for the broker's client connections, in C.

Why: at depth 1 with many connections, every Python server on asyncio + uvloop pays the
loop's per-connection read callback, a stream object's bookkeeping and a write request per
command; a server that parses nothing at all (bench/ceiling_server.py) stops at ~1.3x the
Python floor there, while the same constant replies from an epoll loop in C reach ~1.7x
(bench/README.md, "Past the ceiling"). This module takes only the client sockets' accepts, reads
and writes out of uvloop: one epoll set of its own, whose descriptor the asyncio loop watches
(``loop.add_reader``), so timers, busy polling, TLS, Unix sockets, HTTP and replication stay
on the loop unchanged. The protocol objects (broker.connection) see the asyncio Transport
methods they use, with asyncio's semantics:

* ``connection_lost`` always runs from the loop (``call_soon``), never inside close();
* ``close()`` flushes what is buffered first, ``abort()`` drops it;
* ``eof_received()`` returning true keeps the connection open for writing (half-close);
* an exception from a protocol callback goes to the loop's exception handler and aborts
  the connection, as asyncio's ``_fatal_error`` does;
* ``write()`` calls ``pause_writing()`` above the high-water mark and ``resume_writing()``
  once the buffer falls to the low-water mark.
* after ``connection_lost`` the transport holds neither the protocol nor the socket
  (``get_protocol()`` is None), so a closed connection is freed by reference counting.

Replies leave in batches. A ``write()`` made while a poll serves its ready sockets is held by
the transport, and the held replies are sent back to back after every
BATCH_CONNECTIONS connections written to and at the end of the poll (a write from anywhere
else, a timer or a callback, is sent at once). Why: on loopback a send() runs the receiving
socket's TCP input and wakes its reader if it sleeps; with a client process that owns many
connections, sending each reply as soon as it is made woke that client once every four
replies, and perf put a fifth of the broker's CPU in that wake-up path (put 50 x 1). Sent back
to back, replies find it awake: 0.11 wake-ups a reply, and ~3% less CPU a command for the
broker (bench/README.md, "Replies leave in batches"). The bound keeps a
reply from waiting on more than BATCH_CONNECTIONS other connections' commands, and the
sockets of one batch in the CPU cache: one batch per poll of up to 256 sockets did worse at
500 connections. A held reply is the protocol's own bytes object, referenced, not copied:
copied into each connection's buffer, it cost every command a memcpy into a line of memory
gone cold since that connection's last reply (~4 more L2 misses a command at 500
connections, callgrind). A connection's further writes in the same batch go to its buffer
after it. A connection holds at most BATCH_BYTES (or its high-water mark, if lower); a larger
reply is sent at once, after what it holds, so nothing is reordered and flow control is
unchanged. ``close()`` sends what a connection holds at once; ``abort()`` drops it.

Interpreted builds (SPARK_BEANSTALK_PURE=1, no C compiler) use uvloop's own transports.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_EVENTS 256
#define BATCH_CONNECTIONS 32
#define BATCH_BYTES (16 * 1024)
#define READ_SIZE (256 * 1024)

static char read_buffer[READ_SIZE]; /* one loop thread: copied into a bytes object before any callback */

static PyObject *str_data_received, *str_eof_received, *str_connection_lost, *str_pause_writing,
    *str_resume_writing, *str_call_soon, *str_call_exception_handler, *str_close;

typedef struct {
    PyObject_HEAD
    int epfd;
    PyObject *loop;
    Py_ssize_t live; /* transports not yet lost */
    char in_poll;    /* Poller_poll is serving its ready sockets: writes are held */
    int nheld;       /* transports in held[], a reference each */
    struct Transport *held[BATCH_CONNECTIONS];
    unsigned long long batches, batched; /* sends of held replies: batches, and transports sent in them */
} Poller;

typedef struct Transport {
    PyObject_HEAD
    Poller *poller;
    PyObject *protocol;
    PyObject *sock; /* the Python socket: owns the descriptor, closed after connection_lost */
    PyObject *peername;
    PyObject *sockname;
    int fd;
    uint32_t events; /* what epoll watches now (0: not in the set) */
    char closing;    /* close() or abort() called, or a fatal error */
    char paused;     /* pause_reading() */
    char eof;        /* the peer sent FIN */
    char protocol_paused;
    char lost;       /* connection_lost scheduled */
    char started;
    char held;       /* in the poller's held[]: hold, then its buffer, are sent with the batch */
    PyObject *hold;  /* the batch's first reply of this connection (a bytes object), sent before wbuf */
    char *wbuf;
    size_t wpos, wlen, wcap; /* pending output: wbuf[wpos:wlen] */
    size_t high, low;
} Transport;

static PyTypeObject PollerType;
static PyTypeObject TransportType;

static void os_error(Transport *t, int err);

/* -- epoll interest ------------------------------------------------------------------ */

static void update_events(Transport *t)
{
    uint32_t want = 0;
    if (t->fd < 0 || t->lost)
        want = 0;
    else {
        if (t->started && !t->closing && !t->paused && !t->eof)
            want |= EPOLLIN;
        if (t->wlen > t->wpos)
            want |= EPOLLOUT;
    }
    if (want == t->events)
        return;
    struct epoll_event ev;
    /* Edge-triggered: a socket is reported once per change, so a served socket does not stay on
       the ready list and keep the epoll descriptor (which the loop watches) readable for one
       more wasted callback. Every change of interest re-arms it (EPOLL_CTL_MOD re-checks the
       socket), which is what resume_reading needs. EPOLLRDHUP says a FIN came with the data. */
    ev.events = want ? (want | EPOLLET | ((want & EPOLLIN) ? EPOLLRDHUP : 0)) : 0;
    ev.data.ptr = t;
    int op = want == 0 ? EPOLL_CTL_DEL : (t->events == 0 ? EPOLL_CTL_ADD : EPOLL_CTL_MOD);
    /* A descriptor with nothing wanted leaves the set: epoll reports hang-ups and errors even
       when not asked. */
    if (epoll_ctl(t->poller->epfd, op, t->fd, &ev) == 0 || op == EPOLL_CTL_DEL) {
        t->events = want;
        return;
    }
    /* No room in the epoll set (ENOMEM, ENOSPC): a connection that can never be read or
       flushed is lost now rather than held forever. */
    os_error(t, errno);
}

/* -- closing ------------------------------------------------------------------------- */

static void schedule_lost(Transport *t, PyObject *exc)
{
    if (t->lost)
        return;
    t->closing = 1;
    t->lost = 1;
    update_events(t);
    PyObject *meth = PyObject_GetAttrString((PyObject *)t, "_call_connection_lost");
    if (meth == NULL) {
        PyErr_WriteUnraisable((PyObject *)t);
        return;
    }
    PyObject *res = PyObject_CallMethodObjArgs(t->poller->loop, str_call_soon, meth, exc ? exc : Py_None, NULL);
    Py_DECREF(meth);
    if (res == NULL)
        PyErr_WriteUnraisable((PyObject *)t);
    Py_XDECREF(res);
}

static void force_close(Transport *t, PyObject *exc)
{
    t->wpos = t->wlen = 0;
    Py_CLEAR(t->hold);
    if (t->protocol_paused) {
        t->protocol_paused = 0; /* asyncio does not resume a protocol it is about to lose */
    }
    schedule_lost(t, exc);
}

/* An exception from a protocol callback (pending in the thread state): to the loop's handler,
   then the connection is aborted, as asyncio's transports do. */
static void callback_failed(Transport *t, const char *what)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    if (value != NULL && PyErr_GivenExceptionMatches(value, PyExc_OSError)) {
        force_close(t, value); /* as asyncio: an OSError loses the connection without a report */
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return;
    }
    PyObject *ctx = Py_BuildValue("{s:s,s:O,s:O,s:O}", "message", what, "exception", value ? value : Py_None,
                                  "transport", (PyObject *)t, "protocol", t->protocol);
    if (ctx != NULL) {
        PyObject *res = PyObject_CallMethodObjArgs(t->poller->loop, str_call_exception_handler, ctx, NULL);
        if (res == NULL)
            PyErr_WriteUnraisable((PyObject *)t);
        Py_XDECREF(res);
        Py_DECREF(ctx);
    } else {
        PyErr_WriteUnraisable((PyObject *)t);
    }
    force_close(t, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static void os_error(Transport *t, int err)
{
    /* A reset or a broken pipe is the peer going away: connection_lost gets the error, and
       nothing is logged (asyncio logs these at debug level only). */
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    force_close(t, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* -- output -------------------------------------------------------------------------- */

static void maybe_resume_protocol(Transport *t)
{
    if (t->protocol_paused && !t->lost && t->wlen - t->wpos <= t->low) {
        t->protocol_paused = 0;
        PyObject *res = PyObject_CallMethodNoArgs(t->protocol, str_resume_writing);
        if (res == NULL)
            callback_failed(t, "protocol.resume_writing() failed");
        Py_XDECREF(res);
    }
}

static int buffer_append(Transport *t, const char *data, size_t len)
{
    if (t->wpos > 0 && t->wpos == t->wlen)
        t->wpos = t->wlen = 0;
    if (t->wlen + len > t->wcap) {
        if (t->wpos > 0) { /* slide what is left to the front first */
            memmove(t->wbuf, t->wbuf + t->wpos, t->wlen - t->wpos);
            t->wlen -= t->wpos;
            t->wpos = 0;
        }
        if (t->wlen + len > t->wcap) {
            size_t cap = t->wcap ? t->wcap : 4096;
            while (cap < t->wlen + len)
                cap *= 2;
            char *p = PyMem_Realloc(t->wbuf, cap);
            if (p == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->wbuf = p;
            t->wcap = cap;
        }
    }
    memcpy(t->wbuf + t->wlen, data, len);
    t->wlen += len;
    return 0;
}

/* Send what the socket takes now of [*p, *p + *len), moving both on: 0 (all sent, or the socket
   is full), or the errno of a failed send. */
static int send_now(int fd, const char **p, size_t *len)
{
    while (*len > 0) {
        ssize_t n = send(fd, *p, *len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            return errno;
        }
        *p += n;
        *len -= (size_t)n;
    }
    return 0;
}

static void flush(Transport *t)
{
    const char *p = t->wbuf + t->wpos;
    size_t left = t->wlen - t->wpos;
    int err = send_now(t->fd, &p, &left);
    t->wpos = t->wlen - left;
    if (err) {
        os_error(t, err);
        return;
    }
    if (t->wpos == t->wlen) {
        t->wpos = t->wlen = 0;
        if (t->wcap > 65536) { /* a burst's buffer is not kept for the connection's life */
            PyMem_Free(t->wbuf);
            t->wbuf = NULL;
            t->wcap = 0;
        }
    }
    update_events(t);
    maybe_resume_protocol(t); /* also while closing, as asyncio does */
    if (t->closing && t->wlen == 0)
        schedule_lost(t, NULL);
}

/* Bytes written and not sent yet: the buffer's, and a held reply's. */
static size_t unsent(Transport *t)
{
    return t->wlen - t->wpos + (t->hold != NULL ? (size_t)PyBytes_GET_SIZE(t->hold) : 0);
}

/* The held reply goes into the buffer, ahead of what comes next (the buffer is empty while a reply
   is held: every write to a holding connection comes here first). */
static int release_hold(Transport *t)
{
    PyObject *hold = t->hold;
    t->hold = NULL;
    int rc = buffer_append(t, PyBytes_AS_STRING(hold), (size_t)PyBytes_GET_SIZE(hold));
    Py_DECREF(hold);
    return rc;
}

/* Send a connection's held reply straight from its bytes object; what the socket does not take
   goes into the buffer, to be flushed when it is writable. */
static void send_hold(Transport *t)
{
    PyObject *hold = t->hold;
    t->hold = NULL;
    const char *p = PyBytes_AS_STRING(hold);
    size_t len = (size_t)PyBytes_GET_SIZE(hold);
    int err = send_now(t->fd, &p, &len);
    if (err)
        os_error(t, err);
    else if (len > 0 && buffer_append(t, p, len) < 0)
        callback_failed(t, "out of memory buffering a reply");
    Py_DECREF(hold);
}

/* Send every held reply (the poller's held[] empties). A callback that flush() runs (resume_writing)
   may write again: such a write starts the next batch in held[], so this one is sent from a copy. */
static void send_held(Poller *p)
{
    int n = p->nheld;
    if (n == 0)
        return;
    Transport *batch[BATCH_CONNECTIONS];
    memcpy(batch, p->held, (size_t)n * sizeof(Transport *));
    p->nheld = 0;
    p->batches++;
    p->batched += (unsigned long long)n;
    for (int i = 0; i < n; i++) {
        Transport *t = batch[i];
        t->held = 0;
        if (t->hold != NULL && !t->lost)
            send_hold(t);
        if (!t->lost && t->wlen > t->wpos)
            flush(t);
        Py_DECREF(t);
    }
}

/* Keep this write for the poll's next batch (see the header): 1 if kept, 0 if it must go out now
   instead (after what the connection holds: the caller releases that first), -1 on an error. */
static int hold_write(Transport *t, PyObject *data, const char *buf, size_t len)
{
    Poller *p = t->poller;
    if (!p->in_poll)
        return 0;
    size_t limit = t->high < BATCH_BYTES ? t->high : BATCH_BYTES;
    if (t->held) { /* a further write in this batch: into the buffer, after the held reply */
        if (unsent(t) + len > limit)
            return 0;
        if (t->hold != NULL && release_hold(t) < 0)
            return -1;
        return buffer_append(t, buf, len) < 0 ? -1 : 1;
    }
    if (t->wlen > t->wpos || len > limit) /* output waiting for the socket goes first; a big reply now */
        return 0;
    if (p->nheld == BATCH_CONNECTIONS)
        send_held(p);
    Py_INCREF(t);
    p->held[p->nheld++] = t;
    t->held = 1;
    if (PyBytes_CheckExact(data)) { /* immutable: referenced; anything else is copied, as asyncio does */
        Py_INCREF(data);
        t->hold = data;
        return 1;
    }
    return buffer_append(t, buf, len) < 0 ? -1 : 1;
}

static PyObject *Transport_write(Transport *t, PyObject *data)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError, "data argument must be a bytes-like object, not %.100s",
                     Py_TYPE(data)->tp_name);
        return NULL;
    }
    if (t->closing || t->fd < 0 || view.len == 0) { /* asyncio drops writes after close the same way */
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    const char *p = view.buf;
    size_t len = (size_t)view.len;
    int kept = hold_write(t, data, p, len);
    if (kept == 0 && t->hold != NULL)
        kept = release_hold(t) < 0 ? -1 : 0;
    if (kept != 0) {
        PyBuffer_Release(&view);
        if (kept < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    if (t->wlen == t->wpos) {
        int err = send_now(t->fd, &p, &len);
        if (err) {
            PyBuffer_Release(&view);
            os_error(t, err);
            Py_RETURN_NONE;
        }
        if (len == 0) {
            PyBuffer_Release(&view);
            Py_RETURN_NONE;
        }
    }
    int rc = buffer_append(t, p, len);
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    update_events(t);
    if (t->lost)
        Py_RETURN_NONE;
    if (!t->protocol_paused && t->wlen - t->wpos > t->high) {
        t->protocol_paused = 1;
        PyObject *res = PyObject_CallMethodNoArgs(t->protocol, str_pause_writing);
        if (res == NULL)
            callback_failed(t, "protocol.pause_writing() failed");
        Py_XDECREF(res);
    }
    Py_RETURN_NONE;
}

static PyObject *Transport_writelines(Transport *t, PyObject *seq)
{
    PyObject *it = PyObject_GetIter(seq);
    if (it == NULL)
        return NULL;
    PyObject *item;
    while ((item = PyIter_Next(it)) != NULL) {
        PyObject *res = Transport_write(t, item);
        Py_DECREF(item);
        if (res == NULL) {
            Py_DECREF(it);
            return NULL;
        }
        Py_DECREF(res);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* -- input --------------------------------------------------------------------------- */

static void read_end(Transport *t, ssize_t n);
static int deliver(Transport *t, ssize_t n);

/* Report the socket again at the next poll (EPOLL_CTL_MOD re-checks it and queues an edge if it
   is still ready). */
static void rearm(Transport *t)
{
    struct epoll_event ev;
    ev.events = t->events | EPOLLET | ((t->events & EPOLLIN) ? EPOLLRDHUP : 0);
    ev.data.ptr = t;
    if (t->events && epoll_ctl(t->poller->epfd, EPOLL_CTL_MOD, t->fd, &ev) < 0)
        os_error(t, errno);
}

/* One edge: one read, as uvloop does per connection and loop pass, so that a client sending
   faster than its commands run cannot hold the loop (and every other client, timer and signal)
   in this call. A full buffer may have more behind it: the socket is re-armed for the next
   poll. A short read drains the socket; if the peer's FIN came too, the next read is the EOF. */
static void do_read(Transport *t, uint32_t ev)
{
    for (;;) {
        ssize_t n = recv(t->fd, read_buffer, READ_SIZE, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n == 0 || n < 0) {
            read_end(t, n);
            return;
        }
        if (!deliver(t, n))
            return;
        if (t->lost || !(t->events & EPOLLIN))
            return; /* closed or paused: resume_reading re-arms */
        if ((size_t)n == READ_SIZE) {
            rearm(t);
            return;
        }
        if (!(ev & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)))
            return;
    }
}

/* recv gave 0 (EOF) or an error. */
static void read_end(Transport *t, ssize_t n)
{
    if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            os_error(t, errno);
        return;
    }
    if (n == 0) {
        t->eof = 1;
        update_events(t);
        PyObject *res = PyObject_CallMethodNoArgs(t->protocol, str_eof_received);
        if (res == NULL) {
            callback_failed(t, "protocol.eof_received() call failed.");
            return;
        }
        int keep = PyObject_IsTrue(res);
        Py_DECREF(res);
        if (keep < 0) {
            callback_failed(t, "protocol.eof_received() call failed.");
            return;
        }
        if (keep == 0) {
            PyObject *r = PyObject_CallMethodNoArgs((PyObject *)t, str_close);
            Py_XDECREF(r);
            if (r == NULL)
                PyErr_WriteUnraisable((PyObject *)t);
        }
        return;
    }
}

/* Hand n bytes of the read buffer to the protocol; 0 if that failed (the connection is lost). */
static int deliver(Transport *t, ssize_t n)
{
    PyObject *data = PyBytes_FromStringAndSize(read_buffer, n);
    if (data == NULL) {
        callback_failed(t, "out of memory reading a connection");
        return 0;
    }
    PyObject *args[2] = {t->protocol, data};
    PyObject *res = PyObject_VectorcallMethod(str_data_received, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(data);
    if (res == NULL) {
        callback_failed(t, "Fatal error: protocol.data_received() call failed.");
        return 0;
    }
    Py_DECREF(res);
    return 1;
}

/* -- Transport methods ----------------------------------------------------------------- */

static PyObject *Transport_close(Transport *t, PyObject *Py_UNUSED(ignored))
{
    if (t->closing)
        Py_RETURN_NONE;
    t->closing = 1;
    if (t->hold != NULL && release_hold(t) < 0)
        return NULL;
    if (t->held && t->wlen > t->wpos) { /* its held replies go now; flush() loses it once all are sent */
        flush(t);
        Py_RETURN_NONE;
    }
    update_events(t);
    if (t->wlen == t->wpos)
        schedule_lost(t, NULL);
    Py_RETURN_NONE;
}

static PyObject *Transport_abort(Transport *t, PyObject *Py_UNUSED(ignored))
{
    force_close(t, NULL);
    Py_RETURN_NONE;
}

static PyObject *Transport_is_closing(Transport *t, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(t->closing);
}

static PyObject *Transport_pause_reading(Transport *t, PyObject *Py_UNUSED(ignored))
{
    if (!t->closing && !t->paused) {
        t->paused = 1;
        update_events(t);
    }
    Py_RETURN_NONE;
}

static PyObject *Transport_resume_reading(Transport *t, PyObject *Py_UNUSED(ignored))
{
    if (!t->closing && t->paused) {
        t->paused = 0;
        update_events(t);
    }
    Py_RETURN_NONE;
}

static PyObject *Transport_is_reading(Transport *t, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(!t->closing && !t->paused && !t->eof);
}

static PyObject *Transport_get_write_buffer_size(Transport *t, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(unsent(t));
}

static PyObject *Transport_get_write_buffer_limits(Transport *t, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(nn)", (Py_ssize_t)t->low, (Py_ssize_t)t->high);
}

static PyObject *Transport_set_write_buffer_limits(Transport *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"high", "low", NULL};
    PyObject *high_o = Py_None, *low_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OO:set_write_buffer_limits", kwlist, &high_o, &low_o))
        return NULL;
    Py_ssize_t high, low;
    if (high_o == Py_None) {
        if (low_o == Py_None)
            high = 64 * 1024;
        else {
            low = PyLong_AsSsize_t(low_o);
            if (low == -1 && PyErr_Occurred())
                return NULL;
            high = 4 * low;
        }
    } else {
        high = PyLong_AsSsize_t(high_o);
        if (high == -1 && PyErr_Occurred())
            return NULL;
    }
    if (low_o == Py_None)
        low = high / 4;
    else {
        low = PyLong_AsSsize_t(low_o);
        if (low == -1 && PyErr_Occurred())
            return NULL;
    }
    if (!(high >= low && low >= 0)) {
        PyErr_Format(PyExc_ValueError, "high (%zd) must be >= low (%zd) must be >= 0", high, low);
        return NULL;
    }
    t->high = (size_t)high;
    t->low = (size_t)low;
    Py_RETURN_NONE;
}

static PyObject *Transport_get_extra_info(Transport *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"name", "default", NULL};
    const char *name;
    PyObject *dflt = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|O:get_extra_info", kwlist, &name, &dflt))
        return NULL;
    PyObject *v = NULL;
    if (strcmp(name, "peername") == 0)
        v = t->peername;
    else if (strcmp(name, "sockname") == 0) {
        if (t->sockname == Py_None && t->sock != NULL) { /* asked for the first time: accept() leaves it out */
            PyObject *got = PyObject_CallMethod(t->sock, "getsockname", NULL);
            if (got == NULL)
                PyErr_Clear(); /* reset meanwhile: the default, as for a closed transport */
            else
                Py_SETREF(t->sockname, got);
        }
        v = t->sockname;
    }
    else if (strcmp(name, "socket") == 0)
        v = t->sock;
    if (v == NULL || v == Py_None)
        v = dflt;
    Py_INCREF(v);
    return v;
}

static PyObject *Transport_get_protocol(Transport *t, PyObject *Py_UNUSED(ignored))
{
    Py_INCREF(t->protocol);
    return t->protocol;
}

static PyObject *Transport_set_protocol(Transport *t, PyObject *protocol)
{
    Py_INCREF(protocol);
    Py_SETREF(t->protocol, protocol);
    Py_RETURN_NONE;
}

static PyObject *Transport_can_write_eof(Transport *t, PyObject *Py_UNUSED(ignored))
{
    Py_RETURN_FALSE;
}

/* Start reading: after connection_made, as asyncio does (a refusal there closes first). */
static PyObject *Transport_start(Transport *t, PyObject *Py_UNUSED(ignored))
{
    if (!t->started) {
        t->started = 1;
        update_events(t);
    }
    Py_RETURN_NONE;
}

/* Runs from the loop after close()/abort()/an error: the protocol's connection_lost, then the
   descriptor is closed and the poller lets the transport go. */
static PyObject *Transport_call_connection_lost(Transport *t, PyObject *exc)
{
    if (t->fd < 0)
        Py_RETURN_NONE;
    PyObject *res = PyObject_CallMethodOneArg(t->protocol, str_connection_lost, exc);
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    if (res == NULL)
        PyErr_Fetch(&type, &value, &tb);
    Py_XDECREF(res);
    t->events = 0; /* already out of the epoll set (schedule_lost) */
    t->fd = -1;
    PyObject *r = PyObject_CallMethodNoArgs(t->sock, str_close);
    if (r == NULL)
        PyErr_WriteUnraisable(t->sock);
    Py_XDECREF(r);
    /* As asyncio's transports: let the protocol and the socket go, so that the protocol's reference
       back to this transport is no cycle for the garbage collector to find (None, not NULL: every
       other method may still run). */
    Py_INCREF(Py_None);
    Py_SETREF(t->protocol, Py_None);
    Py_INCREF(Py_None);
    Py_SETREF(t->sock, Py_None);
    t->poller->live--;
    Py_CLEAR(t->hold);
    PyMem_Free(t->wbuf);
    t->wbuf = NULL;
    t->wcap = t->wpos = t->wlen = 0;
    Py_DECREF(t); /* the poller's reference, taken in Transport_new */
    if (type != NULL) {
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Transport_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"poller", "sock", "protocol", "peername", "sockname", NULL};
    PyObject *poller, *sock, *protocol, *peername = Py_None, *sockname = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OO|OO:Transport", kwlist, &PollerType, &poller, &sock,
                                     &protocol, &peername, &sockname))
        return NULL;
    PyObject *fdo = PyObject_CallMethod(sock, "fileno", NULL);
    if (fdo == NULL)
        return NULL;
    int fd = (int)PyLong_AsLong(fdo);
    Py_DECREF(fdo);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "the socket is closed");
        return NULL;
    }
    Transport *t = (Transport *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    Py_INCREF(poller);
    t->poller = (Poller *)poller;
    Py_INCREF(sock);
    t->sock = sock;
    Py_INCREF(protocol);
    t->protocol = protocol;
    Py_INCREF(peername);
    t->peername = peername;
    Py_INCREF(sockname);
    t->sockname = sockname;
    t->fd = fd;
    t->high = 64 * 1024;
    t->low = 16 * 1024;
    t->poller->live++;
    Py_INCREF(t); /* held while the connection lives: epoll's events point here */
    return (PyObject *)t;
}

static int Transport_traverse(Transport *t, visitproc visit, void *arg)
{
    Py_VISIT(t->poller);
    Py_VISIT(t->protocol);
    Py_VISIT(t->sock);
    Py_VISIT(t->peername);
    Py_VISIT(t->sockname);
    Py_VISIT(t->hold);
    return 0;
}

static int Transport_clear(Transport *t)
{
    Py_CLEAR(t->protocol);
    Py_CLEAR(t->sock);
    Py_CLEAR(t->peername);
    Py_CLEAR(t->sockname);
    Py_CLEAR(t->hold);
    Py_CLEAR(t->poller);
    return 0;
}

static void Transport_dealloc(Transport *t)
{
    PyObject_GC_UnTrack(t);
    Transport_clear(t);
    PyMem_Free(t->wbuf);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef Transport_methods[] = {
    {"write", (PyCFunction)Transport_write, METH_O, "Send now what the socket takes; buffer the rest."},
    {"writelines", (PyCFunction)Transport_writelines, METH_O, NULL},
    {"close", (PyCFunction)Transport_close, METH_NOARGS, "Flush, then lose the connection."},
    {"abort", (PyCFunction)Transport_abort, METH_NOARGS, "Drop the output and lose the connection."},
    {"is_closing", (PyCFunction)Transport_is_closing, METH_NOARGS, NULL},
    {"pause_reading", (PyCFunction)Transport_pause_reading, METH_NOARGS, NULL},
    {"resume_reading", (PyCFunction)Transport_resume_reading, METH_NOARGS, NULL},
    {"is_reading", (PyCFunction)Transport_is_reading, METH_NOARGS, NULL},
    {"get_write_buffer_size", (PyCFunction)Transport_get_write_buffer_size, METH_NOARGS, NULL},
    {"get_write_buffer_limits", (PyCFunction)Transport_get_write_buffer_limits, METH_NOARGS, NULL},
    {"set_write_buffer_limits", (PyCFunction)(void (*)(void))Transport_set_write_buffer_limits,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {"get_extra_info", (PyCFunction)(void (*)(void))Transport_get_extra_info, METH_VARARGS | METH_KEYWORDS, NULL},
    {"get_protocol", (PyCFunction)Transport_get_protocol, METH_NOARGS, NULL},
    {"set_protocol", (PyCFunction)Transport_set_protocol, METH_O, NULL},
    {"can_write_eof", (PyCFunction)Transport_can_write_eof, METH_NOARGS, NULL},
    {"start", (PyCFunction)Transport_start, METH_NOARGS, "Begin reading (after connection_made)."},
    {"_call_connection_lost", (PyCFunction)Transport_call_connection_lost, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TransportType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "broker._netio.Transport",
    .tp_basicsize = sizeof(Transport),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One client connection's socket, read and written from the poller's epoll set.",
    .tp_new = Transport_new,
    .tp_dealloc = (destructor)Transport_dealloc,
    .tp_traverse = (traverseproc)Transport_traverse,
    .tp_clear = (inquiry)Transport_clear,
    .tp_methods = Transport_methods,
};

/* -- Poller ---------------------------------------------------------------------------- */

static PyObject *Poller_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"loop", NULL};
    PyObject *loop;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:Poller", kwlist, &loop))
        return NULL;
    int epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Poller *p = (Poller *)type->tp_alloc(type, 0);
    if (p == NULL) {
        close(epfd);
        return NULL;
    }
    p->epfd = epfd;
    Py_INCREF(loop);
    p->loop = loop;
    return (PyObject *)p;
}

/* The loop saw the epoll descriptor readable: serve every connection with something to do. */
static PyObject *Poller_poll(Poller *p, PyObject *Py_UNUSED(ignored))
{
    struct epoll_event evs[MAX_EVENTS];
    if (p->epfd < 0)
        Py_RETURN_NONE;
    int n = epoll_wait(p->epfd, evs, MAX_EVENTS, 0);
    if (n < 0) {
        if (errno == EINTR)
            Py_RETURN_NONE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    p->in_poll = 1;
    for (int i = 0; i < n; i++) {
        Transport *t = evs[i].data.ptr;
        uint32_t ev = evs[i].events;
        Py_INCREF(t); /* callbacks may close it: keep it until this event is handled */
        if (!t->lost && (ev & EPOLLOUT || ((ev & (EPOLLERR | EPOLLHUP)) && t->wlen > t->wpos)))
            flush(t);
        if (!t->lost && (t->events & EPOLLIN) && (ev & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)))
            do_read(t, ev);
        Py_DECREF(t);
    }
    p->in_poll = 0;
    send_held(p);
    Py_RETURN_NONE;
}

static PyObject *Poller_fileno(Poller *p, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(p->epfd);
}

static PyObject *Poller_live(Poller *p, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t(p->live);
}

static PyObject *Poller_batches(Poller *p, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(KK)", p->batches, p->batched);
}

static PyObject *Poller_close(Poller *p, PyObject *Py_UNUSED(ignored))
{
    if (p->epfd >= 0) {
        close(p->epfd);
        p->epfd = -1;
    }
    Py_RETURN_NONE;
}

static int Poller_traverse(Poller *p, visitproc visit, void *arg)
{
    Py_VISIT(p->loop);
    return 0;
}

static int Poller_clear(Poller *p)
{
    Py_CLEAR(p->loop);
    return 0;
}

static void Poller_dealloc(Poller *p)
{
    PyObject_GC_UnTrack(p);
    if (p->epfd >= 0)
        close(p->epfd);
    Poller_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef Poller_methods[] = {
    {"poll", (PyCFunction)Poller_poll, METH_NOARGS, "Serve the connections epoll reports ready (never blocks)."},
    {"fileno", (PyCFunction)Poller_fileno, METH_NOARGS, "The epoll descriptor, for loop.add_reader."},
    {"live", (PyCFunction)Poller_live, METH_NOARGS, "Transports whose connection_lost has not run yet."},
    {"batches", (PyCFunction)Poller_batches, METH_NOARGS,
     "(batches of held replies sent, connections sent in them) since the poller was made."},
    {"close", (PyCFunction)Poller_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PollerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "broker._netio.Poller",
    .tp_basicsize = sizeof(Poller),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One epoll set for the client connections of one loop.",
    .tp_new = Poller_new,
    .tp_dealloc = (destructor)Poller_dealloc,
    .tp_traverse = (traverseproc)Poller_traverse,
    .tp_clear = (inquiry)Poller_clear,
    .tp_methods = Poller_methods,
};

/* -- accept ---------------------------------------------------------------------------- */

/* The peer's address as the socket module gives it: (host, port) for IPv4, (host, port, flowinfo,
   scope_id) for IPv6 (the host without a %scope suffix); None for another family. */
static PyObject *peer_address(const struct sockaddr_storage *ss)
{
    char host[INET6_ADDRSTRLEN];
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        if (inet_ntop(AF_INET, &a->sin_addr, host, sizeof host) != NULL)
            return Py_BuildValue("(si)", host, (int)ntohs(a->sin_port));
    }
    else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        if (inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host) != NULL)
            return Py_BuildValue("(siII)", host, (int)ntohs(a->sin6_port), (unsigned int)ntohl(a->sin6_flowinfo),
                                 (unsigned int)a->sin6_scope_id);
    }
    Py_RETURN_NONE;
}

/* One connection from a listening descriptor, non-blocking, close-on-exec and with TCP_NODELAY, as
   (descriptor, peer address); None when none is waiting. Why in C: socket.accept() builds a socket
   object through two enum conversions, and the empty accept that ends each burst raises
   BlockingIOError; with both, a connection cost ~20,000 more instructions (bench/bench_connect.py). */
static PyObject *netio_accept(PyObject *Py_UNUSED(module), PyObject *arg)
{
    long lfd = PyLong_AsLong(arg);
    if (lfd == -1 && PyErr_Occurred())
        return NULL;
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    memset(&ss, 0, sizeof ss);
    int fd = accept4((int)lfd, (struct sockaddr *)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
            Py_RETURN_NONE; /* a listener still readable is reported again by the loop */
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* a reset peer fails it: its read says so */
    PyObject *peer = peer_address(&ss);
    PyObject *result = peer == NULL ? NULL : Py_BuildValue("(iN)", fd, peer);
    if (result == NULL)
        close(fd);
    return result;
}

static PyMethodDef netio_functions[] = {
    {"accept", (PyCFunction)netio_accept, METH_O,
     "accept(listening_fd) -> (fd, peername) or None: one connection, non-blocking, with TCP_NODELAY."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef netio_module = {
    PyModuleDef_HEAD_INIT, "broker._netio", "Client sockets read and written in C (see broker/netio.py).", -1,
    netio_functions,
};

#define INTERN(var, s)                                                                                           \
    if ((var = PyUnicode_InternFromString(s)) == NULL)                                                           \
        return NULL;

PyMODINIT_FUNC PyInit__netio(void)
{
    INTERN(str_data_received, "data_received");
    INTERN(str_eof_received, "eof_received");
    INTERN(str_connection_lost, "connection_lost");
    INTERN(str_pause_writing, "pause_writing");
    INTERN(str_resume_writing, "resume_writing");
    INTERN(str_call_soon, "call_soon");
    INTERN(str_call_exception_handler, "call_exception_handler");
    INTERN(str_close, "close");
    if (PyType_Ready(&PollerType) < 0 || PyType_Ready(&TransportType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&netio_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&PollerType);
    Py_INCREF(&TransportType);
    if (PyModule_AddObject(m, "Poller", (PyObject *)&PollerType) < 0 ||
        PyModule_AddObject(m, "Transport", (PyObject *)&TransportType) < 0)
        return NULL;
    return m;
}
