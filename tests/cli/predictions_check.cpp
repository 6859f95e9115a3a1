// predictions_check FILE SAMPLES LOGLOSS AUC: checks a `fusekit eval --predictions` file against
// the metrics the same run printed. Every line is `label<TAB>probability` with the label 0 or 1
// and the probability in (0, 1); there are SAMPLES lines; the log loss and the AUC computed here,
// independently of fk::models (double sums, p clamped to [1e-7, 1 - 1e-7] as log_loss does;
// tie-averaged ranks), equal the printed ones to 1e-4 (they are printed to 5 decimals).
// Prints "predictions: ok ..." or what is wrong, exit status 1.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace {

int fail(const std::string& what) {
  std::cerr << "predictions: " << what << "\n";
  return 1;
}

// Mann-Whitney U over tie-averaged ranks.
double roc_auc(std::vector<std::pair<double, int>> s) {
  std::sort(s.begin(), s.end());
  double positive_rank_sum = 0, positives = 0;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t j = i;
    while (j < s.size() && s[j].first == s[i].first) ++j;
    const double rank = (static_cast<double>(i + 1) + static_cast<double>(j)) / 2;  // ranks i+1 .. j
    for (std::size_t k = i; k < j; ++k)
      if (s[k].second == 1) positive_rank_sum += rank, positives += 1;
    i = j;
  }
  const double negatives = static_cast<double>(s.size()) - positives;
  return (positive_rank_sum - positives * (positives + 1) / 2) / (positives * negatives);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) return fail("usage: predictions_check FILE SAMPLES LOGLOSS AUC");
  std::ifstream in(argv[1]);
  if (!in) return fail(std::string("cannot read ") + argv[1]);
  const long long samples = std::atoll(argv[2]);
  const double printed_loss = std::atof(argv[3]), printed_auc = std::atof(argv[4]);
  std::vector<std::pair<double, int>> scored;
  double loss = 0;
  std::string line;
  for (long long n = 1; std::getline(in, line); ++n) {
    const std::size_t tab = line.find('\t');
    char* end = nullptr;
    const double p = tab == std::string::npos ? NAN : std::strtod(line.c_str() + tab + 1, &end);
    const std::string label = line.substr(0, tab);
    if ((label != "0" && label != "1") || !(p > 0 && p < 1) || end == nullptr || *end != '\0')
      return fail("line " + std::to_string(n) + " is not 0|1<TAB>probability in (0, 1): " + line);
    const int y = label == "1";
    const double q = std::clamp(p, 1e-7, 1 - 1e-7);
    loss -= y ? std::log(q) : std::log(1 - q);
    scored.emplace_back(p, y);
  }
  if (static_cast<long long>(scored.size()) != samples)
    return fail(std::to_string(scored.size()) + " lines, the test set has " + std::to_string(samples));
  loss /= static_cast<double>(scored.size());
  const double auc = roc_auc(scored);
  std::printf("predictions: %zu lines, logloss %.6f (printed %.5f), AUC %.6f (printed %.5f)\n", scored.size(), loss,
              printed_loss, auc, printed_auc);
  if (std::abs(loss - printed_loss) > 1e-4 || std::abs(auc - printed_auc) > 1e-4)
    return fail("the file's logloss or AUC differs from the printed one by more than 1e-4");
  std::printf("predictions: ok\n");
  return 0;
}
