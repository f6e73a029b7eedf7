/*
 * A small strict JSON parser (RFC 8259) for the SIMGPU_CONFIG file: objects, arrays, strings with
 * all escapes (\uXXXX incl. surrogate pairs, encoded to UTF-8), numbers, true/false/null. Nesting
 * is limited (no stack exhaustion on hostile input), trailing garbage is an error, and every error
 * names the line and column so the one-line diagnostic can point at it.
 */
#include "json.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JSON_MAX_DEPTH 64

typedef struct {
    const char *s;
    size_t len, pos;
    char *err;
    size_t errcap;
    int failed;
} parser;

static void fail(parser *p, const char *what) {
    if (p->failed) return;
    p->failed = 1;
    size_t line = 1, col = 1;
    for (size_t i = 0; i < p->pos && i < p->len; i++) {
        if (p->s[i] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    snprintf(p->err, p->errcap, "line %zu column %zu: %s", line, col, what);
}

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r')
            p->pos++;
        else
            break;
    }
}

static int peek(parser *p) { return p->pos < p->len ? (unsigned char)p->s[p->pos] : -1; }

static sim_json *node(parser *p, sim_json_type t) {
    sim_json *j = calloc(1, sizeof *j);
    if (!j)
        fail(p, "out of memory");
    else
        j->type = t;
    return j;
}

static sim_json *parse_value(parser *p, int depth);

static int hex4(parser *p, unsigned *out) {
    if (p->len - p->pos < 4) {
        fail(p, "truncated \\u escape");
        return -1;
    }
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p->s[p->pos++];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else {
            p->pos--;
            fail(p, "invalid hex digit in \\u escape");
            return -1;
        }
    }
    *out = v;
    return 0;
}

static char *parse_string_raw(parser *p) {
    /* p->pos is at the opening quote. The decoded string is never longer than its source text
     * (an escape decodes to at most as many bytes as it is written with), so measure the source
     * up to the closing quote, stepping over escapes (an escaped quote does not end it). */
    size_t start = ++p->pos;
    size_t cap = 16;
    for (size_t i = start; i < p->len && p->s[i] != '"'; i++, cap++)
        if (p->s[i] == '\\' && i + 1 < p->len) {
            i++;
            cap++;
        }
    char *out = malloc(cap + 4);
    if (!out) {
        fail(p, "out of memory");
        return NULL;
    }
    size_t n = 0;
    for (;;) {
        if (p->pos >= p->len) {
            fail(p, "unterminated string");
            free(out);
            return NULL;
        }
        unsigned char c = (unsigned char)p->s[p->pos];
        if (c == '"') {
            p->pos++;
            break;
        }
        if (c < 0x20) {
            fail(p, "control character in string (escape it)");
            free(out);
            return NULL;
        }
        if (c != '\\') {
            out[n++] = (char)c;
            p->pos++;
            continue;
        }
        p->pos++;
        if (p->pos >= p->len) {
            fail(p, "unterminated escape");
            free(out);
            return NULL;
        }
        char e = p->s[p->pos++];
        unsigned cp;
        switch (e) {
        case '"': out[n++] = '"'; break;
        case '\\': out[n++] = '\\'; break;
        case '/': out[n++] = '/'; break;
        case 'b': out[n++] = '\b'; break;
        case 'f': out[n++] = '\f'; break;
        case 'n': out[n++] = '\n'; break;
        case 'r': out[n++] = '\r'; break;
        case 't': out[n++] = '\t'; break;
        case 'u':
            if (hex4(p, &cp) != 0) {
                free(out);
                return NULL;
            }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (p->len - p->pos < 6 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u') {
                    fail(p, "unpaired UTF-16 surrogate in \\u escape");
                    free(out);
                    return NULL;
                }
                p->pos += 2;
                if (hex4(p, &lo) != 0) {
                    free(out);
                    return NULL;
                }
                if (lo < 0xDC00 || lo > 0xDFFF) {
                    fail(p, "invalid UTF-16 low surrogate in \\u escape");
                    free(out);
                    return NULL;
                }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                fail(p, "unpaired UTF-16 surrogate in \\u escape");
                free(out);
                return NULL;
            }
            if (cp == 0) {
                fail(p, "\\u0000 is not allowed in this file");
                free(out);
                return NULL;
            }
            /* UTF-8 of at most 4 bytes from 6 source bytes: fits the capacity */
            if (cp < 0x80) {
                out[n++] = (char)cp;
            } else if (cp < 0x800) {
                out[n++] = (char)(0xC0 | (cp >> 6));
                out[n++] = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                out[n++] = (char)(0xE0 | (cp >> 12));
                out[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                out[n++] = (char)(0x80 | (cp & 0x3F));
            } else {
                out[n++] = (char)(0xF0 | (cp >> 18));
                out[n++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                out[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                out[n++] = (char)(0x80 | (cp & 0x3F));
            }
            break;
        default:
            p->pos--;
            fail(p, "invalid escape in string");
            free(out);
            return NULL;
        }
    }
    out[n] = '\0';
    return out;
}

static sim_json *parse_number(parser *p) {
    size_t start = p->pos;
    int neg = 0, integral = 1;
    if (peek(p) == '-') {
        neg = 1;
        p->pos++;
    }
    if (peek(p) == '0') {
        p->pos++;
    } else if (peek(p) >= '1' && peek(p) <= '9') {
        while (peek(p) >= '0' && peek(p) <= '9') p->pos++;
    } else {
        fail(p, "invalid number");
        return NULL;
    }
    if (peek(p) == '.') {
        integral = 0;
        p->pos++;
        if (!(peek(p) >= '0' && peek(p) <= '9')) {
            fail(p, "invalid number: digits expected after '.'");
            return NULL;
        }
        while (peek(p) >= '0' && peek(p) <= '9') p->pos++;
    }
    if (peek(p) == 'e' || peek(p) == 'E') {
        integral = 0;
        p->pos++;
        if (peek(p) == '+' || peek(p) == '-') p->pos++;
        if (!(peek(p) >= '0' && peek(p) <= '9')) {
            fail(p, "invalid number: digits expected in exponent");
            return NULL;
        }
        while (peek(p) >= '0' && peek(p) <= '9') p->pos++;
    }
    char buf[64];
    size_t n = p->pos - start;
    if (n >= sizeof buf) {
        fail(p, "number too long");
        return NULL;
    }
    memcpy(buf, p->s + start, n);
    buf[n] = '\0';
    sim_json *j = node(p, SIM_JSON_NUMBER);
    if (!j) return NULL;
    j->number = strtod(buf, NULL);
    j->negative = neg;
    if (integral) {
        errno = 0;
        unsigned long long v = strtoull(buf + neg, NULL, 10);
        if (errno == 0) {
            j->is_integer = 1;
            j->integer = v;
        }
    }
    return j;
}

static int expect_word(parser *p, const char *w) {
    size_t n = strlen(w);
    if (p->len - p->pos < n || memcmp(p->s + p->pos, w, n) != 0) {
        fail(p, "invalid literal (expected a value: object, array, string, number, true, false or null)");
        return -1;
    }
    p->pos += n;
    return 0;
}

static sim_json *parse_container(parser *p, int depth, int is_obj) {
    sim_json *j = node(p, is_obj ? SIM_JSON_OBJECT : SIM_JSON_ARRAY);
    if (!j) return NULL;
    p->pos++; /* '{' or '[' */
    sim_json **tail = &j->child;
    skip_ws(p);
    if (peek(p) == (is_obj ? '}' : ']')) {
        p->pos++;
        return j;
    }
    for (;;) {
        skip_ws(p);
        char *key = NULL;
        if (is_obj) {
            if (peek(p) != '"') {
                fail(p, "expected a member name in double quotes");
                sim_json_free(j);
                return NULL;
            }
            key = parse_string_raw(p);
            if (!key) {
                sim_json_free(j);
                return NULL;
            }
            for (sim_json *m = j->child; m; m = m->next) {
                if (strcmp(m->key, key) == 0) {
                    fail(p, "duplicate member name");
                    free(key);
                    sim_json_free(j);
                    return NULL;
                }
            }
            skip_ws(p);
            if (peek(p) != ':') {
                fail(p, "expected ':' after the member name");
                free(key);
                sim_json_free(j);
                return NULL;
            }
            p->pos++;
        }
        sim_json *v = parse_value(p, depth + 1);
        if (!v) {
            free(key);
            sim_json_free(j);
            return NULL;
        }
        v->key = key;
        *tail = v;
        tail = &v->next;
        j->count++;
        skip_ws(p);
        int c = peek(p);
        if (c == ',') {
            p->pos++;
            continue;
        }
        if (c == (is_obj ? '}' : ']')) {
            p->pos++;
            return j;
        }
        fail(p, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
        sim_json_free(j);
        return NULL;
    }
}

static sim_json *parse_value(parser *p, int depth) {
    if (depth > JSON_MAX_DEPTH) {
        fail(p, "nesting too deep");
        return NULL;
    }
    skip_ws(p);
    int c = peek(p);
    sim_json *j;
    switch (c) {
    case -1: fail(p, "unexpected end of file (expected a value)"); return NULL;
    case '{': return parse_container(p, depth, 1);
    case '[': return parse_container(p, depth, 0);
    case '"': {
        char *s = parse_string_raw(p);
        if (!s) return NULL;
        j = node(p, SIM_JSON_STRING);
        if (!j) {
            free(s);
            return NULL;
        }
        j->string = s;
        return j;
    }
    case 't':
    case 'f':
        if (expect_word(p, c == 't' ? "true" : "false") != 0) return NULL;
        j = node(p, SIM_JSON_BOOL);
        if (j) j->boolean = (c == 't');
        return j;
    case 'n':
        if (expect_word(p, "null") != 0) return NULL;
        return node(p, SIM_JSON_NULL);
    default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number(p);
        fail(p, "unexpected character (expected a value: object, array, string, number, true, false or null)");
        return NULL;
    }
}

sim_json *sim_json_parse(const char *text, size_t len, char *err, size_t errcap) {
    parser p = {.s = text, .len = len, .pos = 0, .err = err, .errcap = errcap, .failed = 0};
    if (errcap) err[0] = '\0';
    if (memchr(text, '\0', len)) {
        p.pos = (size_t)((const char *)memchr(text, '\0', len) - text);
        fail(&p, "NUL byte in file");
        return NULL;
    }
    sim_json *j = parse_value(&p, 0);
    if (!j) return NULL;
    skip_ws(&p);
    if (p.pos != p.len) {
        fail(&p, "unexpected content after the top-level value");
        sim_json_free(j);
        return NULL;
    }
    return j;
}

void sim_json_free(sim_json *j) {
    while (j) {
        sim_json *next = j->next;
        sim_json_free(j->child);
        free(j->string);
        free(j->key);
        free(j);
        j = next;
    }
}

const sim_json *sim_json_get(const sim_json *obj, const char *key) {
    if (!obj || obj->type != SIM_JSON_OBJECT) return NULL;
    for (const sim_json *m = obj->child; m; m = m->next)
        if (strcmp(m->key, key) == 0) return m;
    return NULL;
}

const char *sim_json_type_name(sim_json_type t) {
    switch (t) {
    case SIM_JSON_NULL: return "null";
    case SIM_JSON_BOOL: return "a boolean";
    case SIM_JSON_NUMBER: return "a number";
    case SIM_JSON_STRING: return "a string";
    case SIM_JSON_ARRAY: return "an array";
    case SIM_JSON_OBJECT: return "an object";
    }
    return "?";
}
