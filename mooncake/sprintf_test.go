package mooncake_test

import "fmt"

var sprintf = fmt.Sprintf
