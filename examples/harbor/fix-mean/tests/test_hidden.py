import unittest

from stats import mean, total


class HiddenTest(unittest.TestCase):
    def test_mean_of_one(self):
        self.assertEqual(mean([5]), 5)

    def test_mean_of_floats(self):
        self.assertAlmostEqual(mean([0.5, 1.5]), 1.0)

    def test_empty_is_refused(self):
        with self.assertRaises(ValueError):
            mean([])

    def test_total_is_unchanged(self):
        self.assertEqual(total([1, 2, 3]), 6)


if __name__ == "__main__":
    unittest.main()
