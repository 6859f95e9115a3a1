# fusekit train --gpus 1 (a thread and a 1-rank NCCL communicator on cuda:0) against the
# one-process run on the GPU (--device cuda), same data and batches: their final test logloss and
# AUC agree within 5e-4 (the distributed run computes its loss gradient on the host, the
# one-process run on the GPU: a rounding apart, which the TF32 GEMMs carry on over 300 steps). The
# --gpus run's checkpoint (a manifest and one shard file, written from the GPU), evaluated by
# fusekit eval on the GPU, gives the run's own final evaluation. Without a GPU the script prints
# "skipped: no GPU" (ctest: SKIP_REGULAR_EXPRESSION).
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny_dcnv2.json> -DWORK=<scratch folder>.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
execute_process(COMMAND ${FUSEKIT} train --config ${CONFIG} --gpus 1 --checkpoint ${WORK}/gpus1.ckpt
                RESULT_VARIABLE rc OUTPUT_VARIABLE gpus ERROR_VARIABLE err)
message("${gpus}${err}")
if(NOT rc EQUAL 0 AND "${err}" MATCHES "GPUs in \\[0, 0\\)")
  message("skipped: no GPU")
  return()
endif()
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "failed (${rc}): fusekit train --gpus 1")
endif()
fusekit(one train --config ${CONFIG} --device cuda)
fusekit(eval eval --checkpoint ${WORK}/gpus1.ckpt --device cuda)

# "test logloss 0.50023, AUC 0.75409" -> the two numbers in units of 1e-5.
function(final_metrics out_var text what)
  if(NOT "${text}" MATCHES "eval final, step [0-9]+: test logloss 0\\.([0-9]+), AUC 0\\.([0-9]+)")
    message(FATAL_ERROR "no final evaluation in the output of ${what}")
  endif()
  set(${out_var} ${CMAKE_MATCH_1} ${CMAKE_MATCH_2} PARENT_SCOPE)
endfunction()
final_metrics(a "${gpus}" "--gpus 1")
final_metrics(b "${one}" "--device cuda")
foreach(i 0 1)
  list(GET a ${i} x)
  list(GET b ${i} y)
  math(EXPR diff "${x} - ${y}")
  if(diff GREATER 50 OR diff LESS -50)
    message(FATAL_ERROR "--gpus 1 ended at logloss, AUC 0.${a} against the one-process GPU run's 0.${b}: apart by more than 5e-4")
  endif()
endforeach()
string(REGEX MATCH "test logloss [0-9.]+, AUC [0-9.]+" final "${gpus}")
if(final STREQUAL "" OR NOT "${eval}" MATCHES "${final}")
  message(FATAL_ERROR "fusekit eval of the --gpus 1 checkpoint (${eval}) differs from the run's final evaluation (${final})")
endif()
message("--gpus 1 and the one-process GPU run agree: logloss, AUC (1e-5 units) ${a} and ${b}")
