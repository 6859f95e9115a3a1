# fusekit data synth -> fusekit data vocab -> fusekit train --vocabulary on the reference's Kaggle
# split; a damaged vocabulary is refused.
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>.
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
run(${FUSEKIT} data synth --rows 30000 --seed 6 --out ${WORK}/synthetic.bin)
run(${FUSEKIT} data vocab ${WORK}/synthetic.bin --out ${WORK}/synthetic.fkv --min-count 2 --data-set kaggle)
run(${FUSEKIT} train --config ${CONFIG} --data ${WORK}/synthetic.bin --vocabulary ${WORK}/synthetic.fkv
    --data-set kaggle --data-randomize day --print-every 0)
# A truncated vocabulary: training refuses it, naming the file.
execute_process(COMMAND head -c 150 ${WORK}/synthetic.fkv OUTPUT_FILE ${WORK}/truncated.fkv)
execute_process(COMMAND ${FUSEKIT} train --config ${CONFIG} --data ${WORK}/synthetic.bin
                        --vocabulary ${WORK}/truncated.fkv RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "truncated.fkv")
  message(FATAL_ERROR "a truncated vocabulary was not refused by name (${rc})")
endif()
message("vocabulary: the truncated file refused")
