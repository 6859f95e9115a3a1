# fusekit data synth (TSV) -> fusekit data preprocess -> fusekit train --data DIR: the whole path
# of real Criteo data at a small size; training refuses a data set named otherwise.
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
run(${FUSEKIT} data synth --rows 30000 --seed 6 --out ${WORK}/raw.tsv)
run(${FUSEKIT} data preprocess ${WORK}/raw.tsv --out ${WORK}/shards --min-count 2 --threads 2)
run(${FUSEKIT} train --config ${CONFIG} --data ${WORK}/shards --data-randomize day --print-every 0)
# The reference's --processed-data-file: preprocessed on the first run, reused on the second.
foreach(i 1 2)
  run(${FUSEKIT} train --config ${CONFIG} --raw-data-file ${WORK}/raw.tsv --processed-data-file ${WORK}/processed
      --data-generation dataset --print-every 0 --steps 20)
endforeach()
run(${FUSEKIT} data loader-rate ${WORK}/shards --mini-batch-size 1000 --data-workers 2)
execute_process(COMMAND ${FUSEKIT} train --config ${CONFIG} --data ${WORK}/shards --data-set terabyte
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "kaggle")
  message(FATAL_ERROR "kaggle shards trained as --data-set terabyte (${rc})")
endif()
message("preprocess: the other data set refused")
