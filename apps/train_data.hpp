// The data of a `fusekit train` / `fusekit eval` run, opened in one place: synthetic data, or
// whatever data::open_source finds at --data (a Criteo TSV, gzip or not, a fusekit binary file, a
// directory of fusekit data preprocess), split into training and test records as the settings ask,
// with the featurizer that turns its records into model input.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "apps/train_config.hpp"
#include "fusekit/data/criteo.hpp"
#include "fusekit/data/source.hpp"

namespace fk::app {

struct Split {
  std::shared_ptr<data::RecordSource> train, test;  // training records in training order; test records
  std::string description;                          // where they come from, how they were split
};

struct RunData {
  data::Featurizer featurizer;
  std::optional<data::DataSource> source;  // what --data named (none for synthetic data)
  Split split;                             // empty when the data was not read
};

// The run's data. `read` false (a dry run): the data is identified and a preprocessed directory
// opened (its vocabulary sizes the tables), but a TSV is not read and no split is formed; with
// --processed-data-file nothing is opened (it may not exist before the run). fk::Error naming
// the setting when the data cannot serve the settings (no training or test records, another
// data set than --data-set names).
RunData open_data(const TrainConfig& c, bool read = true);

// Records [0, n - test) train and the last `test` records test: test = floor(n * fraction).
std::int64_t test_records(std::int64_t n, double fraction);

// The reference's --processed-data-file: training reads the preprocessed directory, written first
// from --data (a Criteo TSV file) unless it already holds it; c.data then names the directory.
void use_processed_data(TrainConfig& c, const ConfigFlags& flags);

}  // namespace fk::app
