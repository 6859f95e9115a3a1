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
# The reference's Terabyte naming: day files PATH_0, PATH_1, ... preprocessed for --data-set terabyte;
# the reference's MLPerf stop at a test AUC (reached at the first evaluation here).
run(${FUSEKIT} data synth --rows 4000 --seed 7 --out ${WORK}/day_0)
run(${FUSEKIT} data synth --rows 3000 --seed 8 --out ${WORK}/day_1)
run(${FUSEKIT} data synth --rows 2000 --seed 9 --cardinalities mlperf-terabyte --zipf-exponent 0.5 --out ${WORK}/day_2)
run(${FUSEKIT} train --config ${CONFIG} --data-set=terabyte --raw-data-file=${WORK}/day
    --processed-data-file=${WORK}/terabyte --memory-map --mlperf-bin-loader --mlperf-bin-shuffle --mlperf-logging
    --mlperf-auc-threshold=0.01 --test-freq=10 --print-every 0)
run(${FUSEKIT} data loader-rate ${WORK}/shards --mini-batch-size 1000 --data-workers 2 --epochs 2)
execute_process(COMMAND ${FUSEKIT} data synth --rows 10 --cardinalities 5-6 --out ${WORK}/bad.tsv
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "--cardinalities")
  message(FATAL_ERROR "fusekit data synth took 2 cardinalities (${rc}): ${out}${err}")
endif()
execute_process(COMMAND ${FUSEKIT} train --config ${CONFIG} --data ${WORK}/shards --data-set terabyte
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "kaggle")
  message(FATAL_ERROR "kaggle shards trained as --data-set terabyte (${rc})")
endif()
message("preprocess: the other data set refused")
