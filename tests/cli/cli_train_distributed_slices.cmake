# fusekit train --distributed on 1, 2 and 4 ranks, each rank reading only its slice of every global
# batch (data::LoaderOptions::slice_rank): the same samples as the one-rank run, so the same loss
# curve within rounding (every 10th step's loss, printed to 5 decimals, within 1e-5), the same
# samples counted and the same final test logloss and AUC (within 1e-5). Global batches of 130
# (slices of 33, 33, 32, 32 on 4 ranks); the 4-rank run all-reduces its dense gradients in buckets
# of at most 1 kB (--bucket-cap-mb 0.001), the others in the default 25 MiB. Learning rate 0.01:
# at the config's 0.05 the first steps overshoot (loss 3.7 over the first 10), which amplifies the
# N ranks' other order of the reductions to 4e-4 in the loss by step 60 on 4 ranks (as much with
# the loader that read whole batches before, and with any bucket size); at 0.01 the curves agree to
# the printed digits.
# Run with -DFUSEKIT=<binary> -DMPIEXEC=<mpirun> -DCONFIG=<configs/tiny_dcnv2.json> -DWORK=<scratch folder>.
set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
set(common train --config ${CONFIG} --distributed --steps 60 --print-every 10 --mini-batch-size 130
    --test-mini-batch-size 1000 --max-shard-rows 700 --learning-rate 0.01)
function(run out_var)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()
# The numbers a run prints: each progress line's loss, then the final test logloss and AUC, as
# integers in units of 1e-5; and its samples.
function(numbers out_var text)
  string(REGEX MATCHALL "step [0-9]+/60  loss [0-9.]+" lines "${text}")
  string(REGEX MATCH "test logloss [0-9.]+, AUC [0-9.]+" final "${text}")
  string(REGEX MATCHALL "[0-9]+\\.[0-9]+" values "${lines};${final}")
  set(units)
  foreach(v ${values})
    string(REPLACE "." "" v "${v}")
    string(REGEX REPLACE "^0+([0-9])" "\\1" v "${v}")
    list(APPEND units ${v})
  endforeach()
  set(${out_var} "${units}" PARENT_SCOPE)
endfunction()
run(one ${FUSEKIT} ${common})
numbers(want "${one}")
list(LENGTH want n)
if(NOT n EQUAL 8)
  message(FATAL_ERROR "expected 6 losses, a logloss and an AUC from the one-rank run, got: ${want}")
endif()
string(REGEX MATCH "[0-9]+ samples, " samples "${one}")
foreach(np 2 4)
  set(extra)
  if(np EQUAL 4)
    set(extra --bucket-cap-mb 0.001)
  endif()
  run(out ${MPIEXEC} -np ${np} --oversubscribe ${FUSEKIT} ${common} ${extra})
  numbers(got "${out}")
  list(LENGTH got m)
  if(NOT m EQUAL n)
    message(FATAL_ERROR "${np} ranks printed other numbers: ${got} (one rank: ${want})")
  endif()
  foreach(i RANGE 7)
    list(GET want ${i} a)
    list(GET got ${i} b)
    math(EXPR d "${a} - ${b}")
    if(d GREATER 1 OR d LESS -1)
      message(FATAL_ERROR "${np} ranks depart from one rank: ${got} against ${want} (units of 1e-5)")
    endif()
  endforeach()
  if(NOT "${out}" MATCHES "${samples}" OR NOT "${out}" MATCHES "over ${np} ranks")
    message(FATAL_ERROR "${np} ranks counted other samples than one rank's '${samples}'")
  endif()
  if(np EQUAL 4 AND NOT "${out}" MATCHES "gradient buckets: [2-9] of at most 0.00105 MB")
    message(FATAL_ERROR "the 4-rank run did not print several gradient buckets of at most 1 kB")
  endif()
endforeach()
message("distributed slices: the same losses, samples and metrics on 1, 2 and 4 ranks")
