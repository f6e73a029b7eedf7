/*
 * A small strict JSON parser (json.c): the SIMGPU_CONFIG file.
 */
#ifndef VGPU_SIM_JSON_H
#define VGPU_SIM_JSON_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    SIM_JSON_NULL,
    SIM_JSON_BOOL,
    SIM_JSON_NUMBER,
    SIM_JSON_STRING,
    SIM_JSON_ARRAY,
    SIM_JSON_OBJECT
} sim_json_type;

typedef struct sim_json {
    sim_json_type type;
    int boolean;
    double number;
    int is_integer; /* number written without fraction/exponent, fits uint64 or int64 */
    int negative;
    uint64_t integer;       /* magnitude when is_integer */
    char *string;           /* STRING: decoded UTF-8; also the key of an object member */
    char *key;              /* member name when the parent is an object */
    struct sim_json *child; /* first element / member */
    struct sim_json *next;  /* next sibling */
    size_t count;           /* elements / members */
} sim_json;

/* Parse `text` (len bytes). On error returns NULL and writes "line L column C: <what>" to err. */
sim_json *sim_json_parse(const char *text, size_t len, char *err, size_t errcap);
void sim_json_free(sim_json *j);
const sim_json *sim_json_get(const sim_json *obj, const char *key);
const char *sim_json_type_name(sim_json_type t);

#endif
