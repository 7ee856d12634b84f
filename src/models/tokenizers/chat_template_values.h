#pragma once
// The values a chat template computes with (chat_template.h) and Python's operations on them:
// str(), truth, ==, +, indexing and slicing, the string and dict methods, Jinja's filters and
// tests, json.dumps. A TypeError's message is the cause; the renderer adds the origin and line.

#include <nlohmann/json.hpp>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::models::jinja {

using Json = nlohmann::ordered_json;

/// A template value: JSON data, Jinja's Undefined (with the message an operation on it raises),
/// or a namespace() (a shared object, so `set ns.x = ...` is seen through every copy).
struct Value {
  enum class Kind { kUndefined, kData, kNamespace };
  Kind kind = Kind::kUndefined;
  Json json;
  std::shared_ptr<Json> ns;
  std::string why;

  static Value data(Json j) {
    Value v;
    v.kind = Kind::kData;
    v.json = std::move(j);
    return v;
  }
  static Value undefined(std::string why) {
    Value v;
    v.why = std::move(why);
    return v;
  }
};

namespace values {

/// The error of an operation (Python's TypeError, ValueError, Jinja's UndefinedError).
class TypeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using Keywords = std::vector<std::pair<std::string, Value>>;

/// Python's bool(v) (Undefined is false).
bool truthy(const Value& v);
/// Python's str(v) (Undefined is "", None is "None", True is "True", lists and dicts as repr).
std::string to_str(const Value& v);
/// The type's name as Python says it ("str", "int", "list", "dict", "NoneType", "undefined").
std::string type_name(const Value& v);
/// The data of `v` (a namespace's object); Undefined raises.
Json to_json(const Value& v);
/// The items a for loop visits: a list's items, a dict's keys, a string's characters; Undefined
/// gives none.
std::vector<Value> iterate(const Value& v);

Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
/// obj[start:stop:step] (Undefined parts are omitted ones).
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
Value call_method(const Value& obj, const std::string& name, const std::vector<Value>& args,
                  const Keywords& keywords);
/// namespace(), range(), dict(), raise_exception(), strftime_now().
Value call_global(const std::string& name, const std::vector<Value>& args,
                  const Keywords& keywords);
Value apply_filter(const std::string& name, const Value& v, const std::vector<Value>& args,
                   const Keywords& keywords);
bool apply_test(const std::string& name, const Value& v, const std::vector<Value>& args);
/// -v (negative) or +v.
Value negate(const Value& v, bool negative);
/// + - * / // % ** ~
Value binary(const std::string& op, const Value& a, const Value& b);
/// == != < <= > >= in "not in"
bool compare(const std::string& op, const Value& a, const Value& b);

/// The pieces chat_template_values.cpp and chat_template_filters.cpp share.
namespace detail {
/// The code points of a UTF-8 string, each as its bytes (a stray byte is one "code point").
std::vector<std::string> chars(const std::string& s);
/// Python's str.strip / lstrip / rstrip (chars_arg null, None or Undefined: whitespace).
std::string strip(const std::string& s, const Value* chars_arg, bool left, bool right);
std::string ascii_case(std::string s, bool upper);
/// Python's str.title() on ASCII letters.
std::string title(const std::string& s);
/// Numbers and booleans (Python's bool is an int).
bool is_number(const Json& j);
bool is_int(const Json& j);
int64_t as_int(const Json& j);
double as_double(const Json& j);
/// The keyword `name`, else the positional argument at `position`, else null.
const Value* arg(const std::vector<Value>& args, const Keywords& keywords, size_t position,
                 const std::string& name);
/// An integer argument (null, None or Undefined: `fallback`).
int64_t int_arg(const Value* v, int64_t fallback, const std::string& what);
/// Python's ==, with Jinja's Undefined equal only to Undefined.
bool equals(const Value& a, const Value& b);
/// Python's `item in container` (Undefined contains nothing).
bool contains(const Value& container, const Value& item);
}  // namespace detail

/// Python's json.dumps(j, ensure_ascii=, indent=, separators=, sort_keys=) (indent < 0: None).
std::string json_dumps(const Json& j, bool ensure_ascii, int indent, const std::string& item_sep,
                       const std::string& key_sep, bool sort_keys);
/// Python's repr(float).
std::string float_repr(double x);

}  // namespace values
}  // namespace difftrain::models::jinja
