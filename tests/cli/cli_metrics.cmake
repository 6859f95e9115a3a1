# fusekit train --metrics-json: one `train` record per progress line and the position of every
# evaluation. Batches of 500 over the 38,400 training samples are 76 whole ones and one of 400
# per epoch (77 steps); two epochs printed every 50 steps are windows at steps 50, 100, 150 and
# 154, having seen 25000, 38400 + 23 * 500, 38400 + 73 * 500 and 76800 samples. A run resumed at
# step 20 counts the samples of the steps before it. A warmup of 100 steps gives step 50 half the
# rate.
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>.
file(MAKE_DIRECTORY ${WORK})
file(REMOVE ${WORK}/metrics.json ${WORK}/resumed.json ${WORK}/state.ckpt)
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)

# The values of `field` in each record of the array `array` of the JSON text `json`, as a list.
function(field_of out_var json array field)
  string(JSON n LENGTH "${json}" ${array})
  set(values "")
  if(n GREATER 0)
    math(EXPR last "${n} - 1")
    foreach(i RANGE ${last})
      string(JSON v GET "${json}" ${array} ${i} ${field})
      list(APPEND values "${v}")
    endforeach()
  endif()
  set(${out_var} "${values}" PARENT_SCOPE)
endfunction()

function(expect what got want)
  if(NOT "${got}" STREQUAL "${want}")
    message(FATAL_ERROR "${what}: got [${got}], want [${want}]")
  endif()
endfunction()

run(${FUSEKIT} train --config ${CONFIG} --mini-batch-size 500 --epochs 2 --print-every 50 --eval-every 60
    --lr-num-warmup-steps 100 --lr-decay-start-step 100 --metrics-json ${WORK}/metrics.json)
file(READ ${WORK}/metrics.json m)
field_of(steps "${m}" train step)
expect("train windows' steps" "${steps}" "50;100;150;154")
field_of(seen "${m}" train samples_seen)
expect("train windows' samples_seen" "${seen}" "25000;49900;74900;76800")
field_of(epochs "${m}" train epoch)
expect("train windows' epochs" "${epochs}" "0;1;1;1")
field_of(rates "${m}" train learning_rate)
string(REGEX REPLACE "00000+1?(;|$)" "\\1" rates "${rates}")  # 0.10000000000000001 -> 0.1
expect("train windows' learning rates" "${rates}" "0.1;0.2;0.2;0.2")
field_of(losses "${m}" train loss)
foreach(loss IN LISTS losses)
  if(NOT loss MATCHES "^0\\.[0-9]+")
    message(FATAL_ERROR "a window's loss is not a number in (0, 1): ${loss}")
  endif()
endforeach()
# Evaluations at steps 60 and 120, and the final one; the existing keys stay.
field_of(steps "${m}" evaluations step)
expect("evaluations' steps" "${steps}" "60;120;154")
field_of(seen "${m}" evaluations samples_seen)
expect("evaluations' samples_seen" "${seen}" "30000;59900;76800")
field_of(epochs "${m}" evaluations epoch)
expect("evaluations' epochs" "${epochs}" "0;1;1")
field_of(aucs "${m}" evaluations auc)
list(LENGTH aucs n)
expect("evaluations with an auc" "${n}" "3")
string(JSON samples GET "${m}" summary samples)
expect("summary samples" "${samples}" "76800")

run(${FUSEKIT} train --config ${CONFIG} --steps 20 --print-every 10 --checkpoint ${WORK}/state.ckpt)
run(${FUSEKIT} train --config ${CONFIG} --steps 40 --print-every 10 --checkpoint ${WORK}/state.ckpt --resume
    --metrics-json ${WORK}/resumed.json)
file(READ ${WORK}/resumed.json m)
field_of(seen "${m}" train samples_seen)
expect("the resumed run's samples_seen" "${seen}" "3840;5120")
message("metrics: windows and evaluations recorded")
