/*
 * Prints where the parts of a simulator state file are (offsets into sim_shared), for tests
 * that write into a state file as an attacker of that state would.
 */
#include <stddef.h>
#include <stdio.h>

#include "../../shim/sim/common/sim_common.h"

int main(void) {
    printf("active=%zu proc=%zu slot=%zu size=%zu\n", offsetof(sim_shared, active), offsetof(sim_shared, proc),
           sizeof(sim_proc_slot), sizeof(sim_shared));
    return 0;
}
