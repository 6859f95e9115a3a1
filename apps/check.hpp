// `fusekit check`: one short case per op family on each device present, against the family's
// spec (apps/check.cpp says what each case is and why its bound is what it is).
#pragma once

namespace fk::app {

// Prints one line per (family, device) and "check: all passed"; returns 0 when every comparison
// is within its bound, 1 otherwise.
int run_check();

}  // namespace fk::app
