// A hand-worked example of the fused bias + scaled residual + ReLU, y = max(0, x + 2.3 * r + b):
// x [8, 10], r [8, 10], bias [10] and the expected y, all given to 4 decimals.
// The alpha 2.3 is not given with the values; every expected value satisfies it to their precision.
#pragma once

namespace fk::examples {

inline constexpr int kBiasActRows = 8, kBiasActCols = 10;
inline constexpr float kBiasActAlpha = 2.3f;

inline constexpr float kBiasActX[kBiasActRows * kBiasActCols] = {
    -0.9247f, -0.4253f, -2.6438f, 0.1452f,  -0.1209f, -0.5797f, -0.6229f, -0.3284f, -1.0745f, -0.3631f,
    -1.6711f, 2.2655f,  0.3117f,  -0.1842f, 1.2866f,  1.1820f,  -0.1271f, 1.2169f,  1.4353f,  1.0605f,
    -0.4941f, -1.4244f, -0.7244f, -1.2973f, 0.0697f,  -0.0074f, 1.8969f,  0.6878f,  -0.0779f, -0.8373f,
    1.3506f,  -0.2879f, -0.5965f, -0.3283f, -0.9086f, -0.8059f, -0.7407f, -0.0504f, 0.5435f,  1.5150f,
    0.0141f,  0.4532f,  1.6349f,  0.7124f,  -0.1806f, 1.0252f,  -1.4622f, -0.7554f, -0.1836f, 0.3824f,
    0.3918f,  -0.0830f, 0.8971f,  -1.1123f, 0.1116f,  0.4863f,  -0.5499f, -0.3231f, -0.5469f, 0.9049f,
    0.2837f,  0.1210f,  0.4730f,  -1.0823f, -0.0334f, -0.9734f, 0.9559f,  -1.1795f, -1.0064f, 0.1160f,
    0.6852f,  -0.4124f, -0.6738f, -0.5404f, 0.6898f,  -1.5517f, 0.3805f,  -0.0436f, 0.3597f,  -0.5043f};

inline constexpr float kBiasActBias[kBiasActCols] = {0.1808f, -0.5523f, 0.9238f, -0.7350f, 1.3800f,
                                               0.8676f, 0.1297f,  -0.9406f, 0.8109f, 0.8821f};

inline constexpr float kBiasActR[kBiasActRows * kBiasActCols] = {
    2.5441f,  -0.7163f, -0.4934f, 0.1267f,  0.1014f,  -0.4035f, 0.9023f,  0.8099f,  -0.6884f, 0.1372f,
    1.0377f,  0.0925f,  -0.3752f, -0.0908f, 2.0639f,  -1.8164f, -0.2719f, 0.2811f,  -1.0399f, 0.7765f,
    0.8814f,  0.0444f,  -1.4870f, 1.1334f,  1.3268f,  -1.2616f, 0.9501f,  -0.6558f, 0.9098f,  -0.6290f,
    -0.6587f, 2.0811f,  1.4151f,  -0.3091f, -0.2055f, 2.0562f,  -0.0490f, -0.6361f, -0.5359f, -0.1310f,
    -0.2945f, 1.2275f,  1.0549f,  0.3576f,  1.6378f,  -0.2310f, 0.7883f,  -0.0807f, -0.3924f, 1.2673f,
    1.0420f,  -0.4945f, -1.1637f, 1.5740f,  0.7116f,  0.6104f,  1.2852f,  -0.6533f, 1.1171f,  -1.0067f,
    1.2912f,  1.6028f,  0.1332f,  1.0703f,  -1.1161f, -0.8396f, -3.6680f, 0.8189f,  0.1255f,  -0.7691f,
    0.1552f,  -0.8782f, -0.4734f, 0.9690f,  -1.9985f, 0.1030f,  0.8580f,  0.7625f,  -1.2587f, -0.8183f};

inline constexpr float kBiasActExpected[kBiasActRows * kBiasActCols] = {
    5.1076f, 0.0000f, 0.0000f, 0.0000f, 1.4922f, 0.0000f, 1.5820f, 0.5938f, 0.0000f, 0.8346f,
    0.8966f, 1.9261f, 0.3726f, 0.0000f, 7.4136f, 0.0000f, 0.0000f, 0.9228f, 0.0000f, 3.7285f,
    1.7140f, 0.0000f, 0.0000f, 0.5746f, 4.5014f, 0.0000f, 4.2118f, 0.0000f, 2.8254f, 0.0000f,
    0.0165f, 3.9464f, 3.5820f, 0.0000f, 0.0000f, 4.7910f, 0.0000f, 0.0000f, 0.1218f, 2.0957f,
    0.0000f, 2.7243f, 4.9850f, 0.7998f, 4.9664f, 1.3615f, 0.4806f, 0.0000f, 0.0000f, 4.1793f,
    2.9691f, 0.0000f, 0.0000f, 1.7729f, 3.1283f, 2.7577f, 2.5356f, 0.0000f, 2.8334f, 0.0000f,
    3.4343f, 3.2553f, 1.7032f, 0.6444f, 0.0000f, 0.0000f, 0.0000f, 0.0000f, 0.0932f, 0.0000f,
    1.2229f, 0.0000f, 0.0000f, 0.9534f, 0.0000f, 0.0000f, 2.4837f, 0.7694f, 0.0000f, 0.0000f};

// Inputs rounded to 4 decimals (error <= 5e-5 each) through x + 2.3*y + b: the expected values
// are reproducible to 5e-5 * (1 + 2.3 + 1) plus their own rounding of 5e-5, about 2.7e-4.
inline constexpr double kBiasActTolerance = 3e-4;

}  // namespace fk::examples
